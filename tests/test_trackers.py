"""--log_to: TensorBoard and Weights & Biases get the records log.jsonl gets, read back here with their own
readers; a resumed run goes on in its W&B run and shows no TensorBoard step twice; a missing package is one
error line, a tracker that fails mid-run one warning line."""

import errno
import json
import os
import signal
import struct
import sys
from pathlib import Path

import pytest

import train
from config import UserError
from tinygpt import files

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "config" / "tiny.toml")  # 20 steps, evaluations at 0, 10 and 20, a record every 5 steps


def read_log(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / "log.jsonl")]


def tensorboard_scalars(out_dir):
    """{tag: [(step, value), ...]} as TensorBoard's own reader gives them, and the hyperparameters: the reader
    its server reads event files with (without its Rust data server), which hides what a restart at a step
    (purge_step) makes stale, as that server's reservoirs do."""
    pytest.importorskip("tensorboard", reason="optional: pip install -r requirements-dev.txt")
    from google.protobuf.json_format import MessageToDict
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(Path(out_dir) / "tensorboard"), size_guidance={TENSORS: 0})  # 0: keep all
    events.Reload()
    scalars = {tag: [(e.step, make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
               for tag in events.Tags()["tensors"] if events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    return scalars, MessageToDict(HParamsPluginData.FromString(start).session_start_info)["hparams"]


def wandb_records(path):
    """The records of a run's .wandb file: W&B's header, then LevelDB's log format (blocks of 32 KiB, each
    record in chunks with a 7-byte header: checksum, length, type), each a wandb_internal_pb2.Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, chunks = Path(path).read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            yield Record.FromString(chunks)
            chunks = b""


def wandb_runs(out_dir):
    """Each offline run under out_dir/wandb/, oldest first: (run id, name, project, config, history rows)."""
    runs = []
    for path in sorted(Path(out_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        run, config, rows = None, {}, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "config":
                config |= {item.key: json.loads(item.value_json) for item in record.config.update}
            elif kind == "history":  # a key is in key, or in nested_key, as W&B chose to send it
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})  # _step, _runtime: W&B's own
        assert run is not None, (path, path.stat().st_size, [r.WhichOneof("record_type") for r in wandb_records(path)])
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        runs.append((run.run_id, run.display_name, run.project, config, rows))
    return runs


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """W&B offline, its own directories in tmp, and without its system metrics (a sampler that took
    whole cores for a moment, on CI's two)."""
    pytest.importorskip("wandb", reason="optional: pip install -r requirements-dev.txt")
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("WANDB_MODE", "offline")
        m.setenv("WANDB_X_DISABLE_STATS", "true")
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            m.setenv(name, str(home / name.lower()))
        yield


@pytest.fixture(scope="module")
def tracked(data_dir, tmp_path_factory, offline_wandb):
    """A tiny run logged to TensorBoard and W&B both."""
    pytest.importorskip("tensorboard", reason="optional: pip install -r requirements-dev.txt")
    out = tmp_path_factory.mktemp("tracked") / "tiny"
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--log_to=tensorboard,wandb"]) == 0
    return out


def test_tensorboard_reads_back_the_values_of_log_jsonl_step_for_step(tracked):
    scalars, hparams = tensorboard_scalars(tracked)
    log = read_log(tracked)
    keys = {k for record in log for k in record} - {"iter"}
    assert set(scalars) == keys >= {"loss", "lr", "tokens_per_s", "train_loss", "val_loss", "val_bpc"}
    for key in keys:
        assert scalars[key] == [(r["iter"], r[key]) for r in log if key in r], key  # float64: the same numbers
    assert [step for step, _ in scalars["val_loss"]] == [0, 10, 20]
    settings = files.load_checkpoint(tracked / "ckpt.pt")["train_config"]  # as decided: dtype auto is chosen
    assert hparams == settings and settings["dtype"] != "auto" and settings["log_to"] == "tensorboard,wandb"


def test_wandb_offline_holds_the_history_of_log_jsonl_and_the_settings_as_config(tracked):
    [(run_id, name, project, config, rows)] = wandb_runs(tracked)
    assert rows == read_log(tracked)  # a row per record, in order, iter its x axis
    ckpt = files.load_checkpoint(tracked / "ckpt.pt")
    assert config == ckpt["train_config"] and config["dtype"] != "auto"
    assert (run_id, name, project) == (ckpt["wandb_run_id"], "tiny", "tinygpt")  # name: out_dir's


def test_a_run_stopped_by_sigterm_goes_on_in_its_wandb_run_and_shows_no_tensorboard_step_twice(
        data_dir, tmp_path, monkeypatch, offline_wandb):
    pytest.importorskip("tensorboard", reason="optional: pip install -r requirements-dev.txt")

    def log_step(run, *args):
        real_log_step(run, *args)
        if run.it == 13:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop finishes the step, saves ckpt.pt and exits

    real_log_step = train.log_step
    monkeypatch.setattr(train, "log_step", log_step)
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--log_to=tensorboard,wandb", "--log_interval=1"]
    assert train.main(args) == 128 + signal.SIGTERM
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 13
    monkeypatch.setattr(train, "log_step", real_log_step)
    resume = [a for a in args if not a.startswith("--log_to")] + ["--init_from=resume"]  # kept in the checkpoint
    assert train.main(resume) == 0
    log = read_log(tmp_path)
    assert [r["iter"] for r in log if "loss" in r] == list(range(1, 21))
    runs = wandb_runs(tmp_path)
    assert len(runs) == 2 and runs[0][0] == runs[1][0] == files.load_checkpoint(tmp_path / "ckpt.pt")["wandb_run_id"]
    assert runs[0][4] + runs[1][4] == log and runs[1][4][0]["iter"] == 14
    scalars, _ = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == [(r["iter"], r["loss"]) for r in log if "loss" in r]
    assert scalars["val_loss"] == [(r["iter"], r["val_loss"]) for r in log if "val_loss" in r]


def test_a_resumed_run_hides_the_tensorboard_steps_its_log_drops_after_the_checkpoint(data_dir, tmp_path,
                                                                                      monkeypatch):
    def log_step(run, *args):
        real_log_step(run, *args)
        if run.it == 15:  # five steps past the checkpoint at 10, logged everywhere
            raise UserError("the machine went away")

    pytest.importorskip("tensorboard", reason="optional: pip install -r requirements-dev.txt")
    real_log_step = train.log_step
    monkeypatch.setattr(train, "log_step", log_step)
    args = [TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--log_to=tensorboard", "--log_interval=1"]
    assert train.main(args) == 2
    assert max(r["iter"] for r in read_log(tmp_path)) == 15
    monkeypatch.setattr(train, "log_step", real_log_step)
    assert train.main([*args, "--init_from=resume"]) == 0  # log.jsonl cut back to 10, then 11 to 20 again
    log = read_log(tmp_path)
    scalars, _ = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == [(r["iter"], r["loss"]) for r in log if "loss" in r]  # 11 to 15 once: the new ones
    assert [step for step, _ in scalars["loss"]] == list(range(1, 21))


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_package_is_one_error_line_naming_the_install_and_nothing_is_written(
        data_dir, tmp_path, monkeypatch, capsys, tracker):
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)  # imported again, it imports tensorboard
    monkeypatch.setitem(sys.modules, tracker, None)  # makes `import tracker` fail
    out = tmp_path / "out"
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", f"--log_to={tracker}"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: --log_to={tracker} needs the {tracker} package: pip install {tracker}\n"
    assert captured.out == "" and not out.exists()


def test_an_unknown_tracker_is_one_error_line_and_nothing_is_written(data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--log_to=tensorboard,wandbb"]) == 2
    assert capsys.readouterr().err == ("error: --log_to must be tensorboard, wandb or tensorboard,wandb, "
                                       "got 'wandbb'\n")
    assert not out.exists()


def test_a_tracker_that_fails_mid_run_costs_one_warning_and_the_run_finishes_whole(
        data_dir, tmp_path, monkeypatch, capsys, tracked):
    def log(self, record):
        calls.append(record["iter"])
        if len(calls) == 3:  # the third record: the run's tenth step
            raise OSError(errno.ENOSPC, "No space left on device")
        real_log(self, record)

    calls, real_log = [], files.TensorBoard.log
    monkeypatch.setattr(files.TensorBoard, "log", log)
    assert train.main([TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--log_to=tensorboard"]) == 0
    assert capsys.readouterr().err == ("warning: --log_to=tensorboard failed (OSError: [Errno 28] No space left on "
                                       "device); it gets no more records, log.jsonl keeps them all\n")  # all it says
    assert calls == [0, 5, 10]  # dropped: no record after the failure reaches it
    losses = lambda out: [(r["iter"], r.get("loss"), r.get("val_loss")) for r in read_log(out)]  # noqa: E731
    assert losses(tmp_path) == losses(tracked)  # the same run, no tracker failing: every record, whole
    assert files.load_checkpoint(tmp_path / "ckpt.pt")["iter"] == 20
    assert files.load_checkpoint(tmp_path / "best.pt")["val_loss"] == min(r["val_loss"] for r in read_log(tmp_path)
                                                                          if "val_loss" in r)
    scalars, _ = tensorboard_scalars(tmp_path)
    assert [step for step, _ in scalars["loss"]] == [5]  # what it got before it failed

