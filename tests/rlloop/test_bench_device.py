"""The accelerator check (`python -m rlloop.bench device`) runs every part on CPU with --quick: on a lent device
machine there is no time to find out that the script itself is broken."""

import json

from rlloop.bench import device


def test_device_check_runs_every_part_on_cpu(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    device.main(["--quick"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for part in ("engine", "engine_long", "trainer", "tiny", "nccl"):
        assert "error" not in report[part], (part, report[part])
    long = report["engine_long"]
    for run in (report["engine"], long["chunked"], long["whole"]):
        assert run["compiles_after_warmup"] == 0 and run["tok_s"] > 0
        assert 0 < run["mbu"] < 1
    assert report["engine"]["reads_whole_cache"] and report["engine"]["cache_len"] == 16
    assert long["chunked"]["cache_len"] == long["whole"]["cache_len"] == 384  # filled by the responses
    assert long["whole"]["reads_whole_cache"] and not long["chunked"]["reads_whole_cache"]
    assert 0 < report["trainer"]["mfu"] < 1
    assert report["tiny"]["steps"] == 2 and report["tiny"]["compiles"] == 0
    assert report["tiny"]["logprob_abs_diff"] < 1e-4  # fp32 on CPU: engine and trainer agree
    assert report["tiny"]["device_bytes_while_training"] == 0  # colocated: the engine let go of its cache and weights
    assert "needs 2 GPUs" in report["nccl"]["skipped"]
