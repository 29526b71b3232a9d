"""examples/train_lm.py on the CPU (tiny sizes, mok's CPU path and the plain torch engine): --check's runs
(bitwise repeat, resume equality, torch within 2 %), the JSON it writes, a resume across processes, and the
corpus and data pieces. The GPU run (tests marked gpu) is the same --check on one GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
from procs import run

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_lm.py"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    env.setdefault("MOK_COMMIT", "test")
    return env


def run_script(*args, timeout=240) -> str:
    """train_lm.py's output (stdout and stderr); a failure or a hang past ``timeout`` s fails the test."""
    return run([sys.executable, str(SCRIPT), *args], timeout, f"train_lm.py {' '.join(args)}", env=_env(), cwd=ROOT)


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("train_lm", None)


@pytest.fixture(scope="module")
def check_run(tmp_path_factory):
    """One --check on the CPU: runs A, B, A resumed from step 4, the torch engine (8 steps each)."""
    tmp = tmp_path_factory.mktemp("check")
    out = run_script("--device", "cpu", "--check", "--steps", "8", "--out-dir", str(tmp / "out"),
                     "--results-dir", str(tmp / "results"), "--no-tqdm", "--no-plot")
    return tmp, out


def test_check_passes_and_prints_the_summary(check_run):
    _, out = check_run
    assert "train_lm check: PASSED" in out
    for line in ("bitwise_repeat     yes", "resume_equal       yes", "torch_within_2pct  yes"):
        assert line in out


def test_check_record_json(check_run):
    tmp, _ = check_run
    (record,) = list((tmp / "results").glob("*-train_lm-test.json"))
    rec = json.loads(record.read_text())
    assert set(rec) == {"date", "commit", "gpu", "gpus", "command", "results"} and rec["commit"] == "test"
    (entry,) = rec["results"]
    assert entry["bench"] == "train_lm" and entry["ep"] == 1
    m = entry["metrics"]
    for k in ("steps", "final_val_loss", "unigram_entropy", "bitwise_repeat", "resume_equal", "torch_final_val_loss",
              "mok_step_ms", "torch_step_ms"):
        assert k in m, k
    assert m["steps"] == 8 and m["bitwise_repeat"] == 1 and m["resume_equal"] == 1
    assert 0 < m["unigram_entropy"] < math.log(256)
    assert math.isfinite(m["final_val_loss"]) and abs(m["torch_final_val_loss"] / m["final_val_loss"] - 1) < 0.02


def test_check_curves(check_run):
    tmp, _ = check_run
    run = json.loads((tmp / "out" / "train_lm.json").read_text())
    runs = run["runs"]
    assert set(runs) == {"mok", "mok repeat", "mok resumed", "torch"}
    a = runs["mok"]
    assert a["step"] == list(range(1, 9)) and a["val_step"] == [0, 4, 8]
    assert all(math.isfinite(v) for v in a["loss"] + a["val_loss"])
    assert a["val_loss"][-1] < a["val_loss"][0] - 0.3 and a["loss"][-1] < a["loss"][0]  # it learns
    assert runs["mok repeat"]["loss"] == a["loss"]  # bitwise (JSON keeps every bit of a float)
    assert runs["mok resumed"]["loss"][4:] == a["loss"][4:]
    assert runs["torch"]["loss"] != a["loss"]  # another implementation, close but not the same bits
    assert all(abs(t - m) < 0.02 * m for t, m in zip(runs["torch"]["loss"], a["loss"]))


def test_resume_in_a_new_process_gives_the_same_bits(tmp_path):
    base = ["--device", "cpu", "--steps", "6", "--no-tqdm", "--no-plot", "--val-every", "3"]
    run_script(*base, "--save-every", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "a"))
    assert (tmp_path / "ckpt" / "step000003" / "rank000.pt").is_file()
    assert (tmp_path / "ckpt" / "step000006" / "rank000.pt").is_file()
    run_script(*base, "--resume", str(tmp_path / "ckpt" / "step000003"), "--out-dir", str(tmp_path / "b"))
    a = json.loads((tmp_path / "a" / "train_lm.json").read_text())["runs"]["mok"]
    b = json.loads((tmp_path / "b" / "train_lm.json").read_text())["runs"]["mok"]
    assert b["step"] == a["step"] and b["loss"] == a["loss"] and b["val_loss"] == a["val_loss"]


def test_corpus_split_and_entropy(train_lm):
    c = train_lm.load_corpus()
    again = train_lm.load_corpus()
    assert c.sha256 == again.sha256 and torch.equal(c.val, again.val)
    assert c.files > 100 and c.val.numel() < c.train.numel() // 5
    h = c.unigram_entropy()
    assert 2.0 < h < 5.0  # source code: far below log(256) = 5.55


def test_batches_state_roundtrip(train_lm):
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    a = train_lm.Batches(data, 16, 4, seed=3)
    a.next()
    state = a.state_dict()
    expect = a.next()
    b = train_lm.Batches(data, 16, 4, seed=99)
    b.load_state_dict(state)
    assert torch.equal(b.next(), expect) and b.served == 2


def test_init_is_the_same_for_both_engines(train_lm):
    args = train_lm.parse_args(["--device", "cpu"])
    cfg = train_lm.model_config(args, train_lm.Dist())
    models = []
    for engine in train_lm.ENGINES:
        m = train_lm.MoELM(cfg, engine)
        train_lm.init_weights(m, 7, rank=0)
        models.append(m.state_dict())
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_argument_errors(train_lm, capsys):
    with pytest.raises(SystemExit) as e:
        train_lm.parse_args(["--device", "cpu", "--layers", "0"])
    assert e.value.code == 2 and "--layers must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--device", "cpu", "--check", "--resume", "somewhere"])


def test_precision_argument(train_lm, capsys):
    args = train_lm.parse_args(["--device", "cpu"])
    assert args.precision == "bf16" and train_lm.run_precision(args, "mok") == "bf16"
    args = train_lm.parse_args(["--device", "cuda", "--precision", "fp8"])  # parsing needs no GPU
    assert train_lm.run_precision(args, "mok") == "fp8_block" and train_lm.run_precision(args, "torch") == "bf16"
    assert train_lm.parse_args(["--device", "cuda", "--precision", "fp8", "--check"]).precision == "fp8"
    assert train_lm.parse_args(["--device", "cpu", "--precision", "fp8"]).precision == "fp8"  # the CPU emulation
    for argv, message in (
            (["--device", "cuda", "--precision", "fp8", "--engine", "torch"], "use it with --engine mok"),
            (["--device", "cuda", "--precision", "fp16"], "invalid choice: 'fp16'")):
        with pytest.raises(SystemExit) as e:
            train_lm.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_precision_reaches_the_layers(train_lm):
    args = train_lm.parse_args(["--device", "cpu"])
    cfg = train_lm.model_config(args, train_lm.Dist())
    for precision, name in (("bf16", "bf16"), ("fp8", "fp8_block")):
        m = train_lm.MoELM(cfg, "mok", precision=precision)
        assert {b.moe.spec.config.precision for b in m.blocks} == {name}


def test_check_json_records_the_precision(check_run):
    tmp, out = check_run
    assert "mok precision bf16" in out
    run = json.loads((tmp / "out" / "train_lm.json").read_text())
    assert run["args"]["precision"] == "bf16" and run["results"][0]["precision"] == "bf16"
    assert {r["precision"] for r in run["runs"].values()} == {"bf16"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (mok's kernels)")
def test_fp8_run_on_one_gpu(tmp_path):
    out = run_script("--device", "cuda", "--precision", "fp8", "--steps", "20", "--val-every", "10", "--out-dir",
                     str(tmp_path), "--no-tqdm", "--no-plot", timeout=600)
    run = json.loads((tmp_path / "train_lm.json").read_text())
    assert run["results"][0]["precision"] == "fp8_block" and run["runs"]["mok"]["precision"] == "fp8_block"
    losses = run["runs"]["mok"]["loss"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (mok's kernels)")
def test_check_on_one_gpu(tmp_path):
    out = run_script("--device", "cuda", "--check", "--steps", "40", "--val-every", "20", "--out-dir",
                     str(tmp_path), "--no-tqdm", "--no-plot", timeout=600)
    assert "train_lm check: PASSED" in out
