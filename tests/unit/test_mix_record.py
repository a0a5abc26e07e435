"""serve --record-mix with several writers (the replicas of serve --replicas): one clock, whole lines."""
import json
import multiprocessing as mp

from mixserve.server.mix_record import MixRecorder


def _writer(path: str, t0: float, who: int, n: int) -> None:
    rec = MixRecorder(path, "m", 16, text=True, t0=t0)
    for i in range(n):
        # 40 KiB of text per line: far over a buffered file's 8 KiB, so a split write would show
        rec.record(arrival_wall=t0 + who + i / 100, prompt_ids=list(range(40)), output_ids=[1, 2], cached_tokens=0,
                   finish_reason="length", ttft_s=0.1, tpot_s=0.01, tag=f"w{who}", salt=None,
                   prompt_text=str(who) * 40_000, output_text="ab")
    rec.close()


def test_processes_share_one_file_and_one_clock(tmp_path):
    path = str(tmp_path / "mix.jsonl")
    t0 = 1_700_000_000.0
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, t0, w, 30)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = [json.loads(s) for s in open(path, encoding="utf-8")]
    assert len(lines) == 90
    for d in lines:
        w = int(d["tag"][1])
        assert d["prompt"] == str(w) * 40_000  # whole: no other writer's bytes inside
        assert w <= d["arrival_s"] < w + 0.3  # counted from the shared t0, not each writer's start


def test_a_closed_recorder_refuses_to_write(tmp_path):
    rec = MixRecorder(str(tmp_path / "m.jsonl"), "m", 16)
    rec.close()
    rec.close()  # twice is harmless
    try:
        rec.record(arrival_wall=0.0, prompt_ids=[1], output_ids=[2], cached_tokens=0, finish_reason="stop",
                   ttft_s=None, tpot_s=None, tag="t", salt=None)
    except ValueError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed recorder wrote a line")
