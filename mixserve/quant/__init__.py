"""Weight-only int4 quantization: AWQ (Lin et al., MLSys 2024) and round-to-nearest."""
