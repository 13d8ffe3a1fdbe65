"""Issue 18 replayed: runs that never hang, never lose or mix data, and never execute what they
load. Checkpoints: a booby-trapped or altered checkpoint is never run or trusted but set aside
with one line, the run id ties checkpoints to metrics, and a changed setting is named. (SIGKILL
+ --resume bitwise and kills during a checkpoint write are in test_resume.py.)"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import files_under, metric_steps, run_cli

from grpolab.run import checkpoint
from grpolab.run.report import read_metrics

pytestmark = pytest.mark.slow  # CLI workshop runs from the SFT start (world_args)


class _Payload:
    """Pickles to a call of os.system: what a booby-trapped last.pt carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_in_a_checkpoint_is_never_run(tmp_path: Path, world_args: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out, marker = tmp_path / "run", tmp_path / "PWNED"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "2"], capsys)[0] == 0
    ckpt = out / "checkpoints"
    torch.save({"step": 2, "backend": _Payload(marker)}, ckpt / "last.pt")

    code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0 and not marker.exists()
    assert len(err) == 1 and "last.pt" in err[0] and "moved aside" in err[0], err
    assert "prev.pt (step 1)" in err[0]
    assert metric_steps(out) == [0, 1, 2, 3]
    # the file was set aside, not deleted: and it really carried a live payload
    assert (ckpt / "last.pt.corrupt").exists() and not marker.exists()
    torch.load(ckpt / "last.pt.corrupt", weights_only=False)
    assert marker.exists()
    marker.unlink()

    # both files trapped: one line, exit 1, nothing run, nothing moved
    torch.save({"step": 3, "x": _Payload(marker)}, ckpt / "last.pt")
    torch.save({"step": 2, "x": _Payload(marker)}, ckpt / "prev.pt")
    before = files_under(out)
    code, err = run_cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 1 and len(err) == 1 and "no readable checkpoint" in err[0], err
    assert err[0].count("could run code when loaded") == 2
    assert not marker.exists() and files_under(out) == before

    # both overwritten with garbage: named as such, not as torch's weights_only advice
    for name in ("last.pt", "prev.pt"):
        (ckpt / name).write_bytes(os.urandom(4096))
    before = files_under(out)
    code, err = run_cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 1 and len(err) == 1 and err[0].count("not a checkpoint file") == 2, err
    assert files_under(out) == before


def _tensor_offset(path: Path) -> int:
    """Where the largest tensor's bytes start inside a torch zip file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len, extra_len = (int.from_bytes(raw[info.header_offset + k : info.header_offset + k + 2],
                                          "little") for k in (26, 28))
    return info.header_offset + 30 + name_len + extra_len


def test_altered_tensor_bytes_are_caught_and_set_aside(tmp_path: Path, world_args: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "2"], capsys)[0] == 0
    last = out / "checkpoints" / "last.pt"
    good = torch.load(last, weights_only=True)
    raw = bytearray(last.read_bytes())
    at = _tensor_offset(last)
    raw[at : at + 64] = bytes((b + 1) % 256 for b in raw[at : at + 64])
    last.write_bytes(raw)
    altered = torch.load(last, weights_only=True)  # the premise: it still loads, silently
    assert any(not torch.equal(a, b) for a, b in zip(altered["backend"]["model"].values(),
                                                      good["backend"]["model"].values()))
    with pytest.raises(checkpoint.CheckpointError, match="content hash mismatch"):
        checkpoint.read(last)

    code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0 and len(err) == 1 and "content hash mismatch" in err[0], err
    assert "last.pt.corrupt" in err[0] and "prev.pt (step 1)" in err[0]
    assert metric_steps(out) == [0, 1, 2, 3]
    # random garbage: the same, and the next resume no longer trips over it
    (out / "checkpoints" / "last.pt").write_bytes(os.urandom(5000))
    code, err = run_cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 0 and len(err) == 1 and "last.pt.corrupt.1" in err[0], err
    code, err = run_cli([*args, "--steps", "4", "--resume"], capsys)
    assert code == 0 and err == []
    assert metric_steps(out) == [0, 1, 2, 3, 4]


def test_run_id_ties_checkpoints_and_metrics(tmp_path: Path, world_args: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "2"], capsys)[0] == 0
    ids = {r["run_id"] for r in read_metrics(out / "metrics.jsonl")}
    st = checkpoint.read(out / "checkpoints" / "last.pt")
    assert ids == {st["run_id"]} and len(st["sha256"]) == 64
    assert {r["run_id"] for r in read_metrics(out / "samples.jsonl")} == ids
    assert run_cli([*args, "--steps", "3", "--resume"], capsys)[0] == 0
    assert {r["run_id"] for r in read_metrics(out / "metrics.jsonl")} == ids  # same run
    assert run_cli([*args, "--steps", "1", "--overwrite"], capsys)[0] == 0
    new = {r["run_id"] for r in read_metrics(out / "metrics.jsonl")}
    assert len(new) == 1 and new != ids and metric_steps(out) == [0, 1]


def test_changed_lora_r_is_named_not_called_unreadable(tmp_path: Path, world_args: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "1"], capsys)[0] == 0
    before = files_under(out)
    code, err = run_cli([*args, "--steps", "2", "--resume", "--lora-r", "4"], capsys)
    assert code == 2 and len(err) == 1, err  # a settings mistake, as another dataset is
    assert "does not fit this model" in err[0] and "lora_r=8 (this run: 4)" in err[0]
    assert "unreadable" not in err[0] and files_under(out) == before


def test_a_hashless_checkpoint_of_another_form_is_one_line(tmp_path: Path,
                                                           world_args: list[str],
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """A checkpoint without a content hash (older grpolab wrote none: loaded without that
    check) whose state is not of the form grpolab keeps (damaged, or made by hand) is one line
    naming the part, exit 1, nothing changed on disk; it was a traceback from the first part
    that would not load (a posterior of another length, a config that is a string...). One of
    the form it keeps still resumes."""
    out = tmp_path / "run"
    args = ["workshop", "--out-dir", str(out), "--checkpoint-every", "1", *world_args]
    assert run_cli([*args, "--steps", "2"], capsys)[0] == 0
    last = out / "checkpoints" / "last.pt"
    good = {k: v for k, v in torch.load(last, weights_only=True).items() if k != "sha256"}
    rates = good["pass_rates"]
    for part, st in [
            ("its config", {**good, "config": "lora"}),
            ("its step", {**good, "step": "2"}),
            ("its prompt sampler", {k: v for k, v in good.items() if k != "sampler"}),
            ("its pass-rate posteriors", {**good, "pass_rates": {**rates,
                                                                 "successes": torch.zeros(3)}}),
            ("its pass-rate posteriors", {**good, "pass_rates": {**rates, "prior": [1.0]}}),
            ("whether it said the unscored answers", {**good, "told_unscored": torch.ones(2)}),
            ("its random state", {**good, "rank_rng": [{"gen": 1}]})]:
        torch.save(st, last)
        before = files_under(out)
        code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
        assert code == 1 and len(err) == 1 and "is damaged (" + part in err[0], (part, err)
        assert files_under(out) == before
    torch.save(good, last)
    code, err = run_cli([*args, "--steps", "3", "--resume"], capsys)
    assert code == 0 and metric_steps(out) == [0, 1, 2, 3]
    assert any("no content hash" in line for line in err), err


def test_a_tensor_where_a_part_belongs_is_named_not_a_traceback() -> None:
    """check_state asks no tensor its truth: a tensor where the per-rank random states or the
    watch's state belong is the damaged-checkpoint line (it was "Boolean value of Tensor with
    more than one value is ambiguous"); those parts absent or empty still pass."""
    from grpolab.run.resume import check_state

    g = torch.Generator().get_state()
    st = {"config": {}, "step": 1, "gen": g, "torch_rng": torch.get_rng_state(),
          "sampler_gen": g, "sampler": {"pass_rate": torch.zeros(3), "visits": torch.zeros(3)}}
    for part, extra in [("its random state", {"rank_rng": torch.zeros(3)}),
                        ("its watch's state", {"watch": torch.zeros(2)}),
                        ("its watch's state", {"entropy_control": torch.ones(4)})]:
        with pytest.raises(checkpoint.CheckpointError, match=r"is damaged \(" + part):
            check_state({**st, **extra}, Path("last.pt"))
    assert check_state({**st, "rank_rng": [], "watch": None, "alarm": {}}, None)["step"] == 1
