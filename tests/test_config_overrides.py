"""`launch --set KEY=VALUE`, the resolved config (the run directory's config.yaml, every
checkpoint's, `status --config`) and `dflash --version`. The CLI runs in-process (click's
CliRunner) where the process boundary is not what is tested."""
from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import dflash_schema
from dflash_cli import DISTRIBUTION, release
from dflash_cli.cli import main
from dflash_run import REPO, dflash
from dflash_train.config import load_job_config, resolved_yaml
from support.train_configs import small_config

CONFIGS = sorted((REPO / "configs" / "train").glob("*.yaml"))


def cli(*args: str) -> Result:
    """`dflash ARGS…` in this process, stdout and stderr apart."""
    return CliRunner().invoke(main, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})


def sets(*overrides: str) -> list[str]:
    return [word for override in overrides for word in ("--set", override)]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """The built-in `local` host's workspace lives under ~; no inventory in the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# --- values and merging -----------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("optim.lr=1e-4", 1e-4), ("optim.lr=3.0e-3", 3e-3), ("x=-2E+3", -2000.0), ("x=12", 12), ("x=true", True),
    ("x=off", False), ("x='off'", "off"), ("x='1e-4'", "1e-4"), ("x=[cuda:0, cuda:1]", ["cuda:0", "cuda:1"]),
    ("x={a: 1}", {"a": 1}), ("x=", None), ("x=a=b", "a=b"), ("x=.nan", "nan")])
def test_a_set_value_is_one_yaml_value(text, value):
    parsed = dflash_schema.parse_override(text).value
    if value == "nan":
        assert parsed != parsed
    else:
        assert parsed == value and type(parsed) is type(value)


def test_exponent_floats_without_a_dot_are_numbers_in_files_too(tmp_path):
    config = small_config(tmp_path / "c.yaml")
    config.write_text(config.read_text().replace("lr: 0.003", "lr: 1e-4"))
    assert "lr: 1e-4" in config.read_text()
    assert load_job_config(config).optim.lr == 1e-4  # PyYAML alone reads the string '1e-4'


def test_an_override_changes_one_of_two_aliased_mappings_only(tmp_path):
    (tmp_path / "f.yaml").write_text("a: &shared {k: 1}\nb: *shared\n")
    data = dflash_schema.read_yaml(tmp_path / "f.yaml")
    assert data["a"] is data["b"]  # what YAML aliases give
    merged = dflash_schema.apply_overrides(data, (dflash_schema.parse_override("a.k=2"),), "f.yaml")
    assert merged == {"a": {"k": 2}, "b": {"k": 1}} and data == {"a": {"k": 1}, "b": {"k": 1}}


# --- refused overrides: the --set is named, nothing is deployed ------------------------------

REGEN = REPO / "configs" / "train" / "regen-tiny-cpu.yaml"


BAD_SETS = [
    (None, ["optim.lrr=1e-4"], "--set optim.lrr=1e-4: optim.lrr: unknown key (known keys: accumulate, betas, epochs, "
                               "grad_clip, lr, max_steps, warmup_ratio, weight_decay)"),
    (None, ["drafter.num_layers=three"],
     "--set drafter.num_layers=three: drafter.num_layers: expected an integer, got a string 'three'"),
    (None, ["drafter.num_layers=2.5"], "--set drafter.num_layers=2.5: drafter.num_layers: expected an integer, "
                                       "got a number 2.5"),
    (None, ["optim.lr=.inf"], "--set optim.lr=.inf: optim.lr: expected a finite number, got .inf"),
    (None, ["optim.lr=-.inf"], "--set optim.lr=-.inf: optim.lr: expected a finite number, got -.inf"),
    (None, ["optim.lr.x=1"], "--set optim.lr.x=1: optim.lr: is a number (0.003), not a mapping, so it has no key 'x'"),
    (None, ["devices.target.0=cpu"], "--set devices.target.0=cpu: devices.target: is a list (['cpu']), not a mapping"),
    (None, ["optim.lr"], "--set optim.lr: expected KEY=VALUE, KEY a dotted path of config keys"),
    (None, ["optim..lr=1"], "--set optim..lr=1: expected KEY=VALUE"),
    (None, ["=1"], "--set =1: expected KEY=VALUE"),
    (None, ["optim.lr=[1e-4"], "--set optim.lr=[1e-4: optim.lr: invalid YAML value"),
    (None, ["optim.lr=1e-4", "optim.lr=2e-4"], "--set optim.lr=2e-4: optim.lr: set twice (also by --set optim.lr=1e-4)"),
    (None, ["optim.lr=-1"], "--set optim.lr=-1: optim: lr and epochs must be positive"),
    (None, ["job=regenerate"], "--set job=regenerate: job: regenerate does not read"),
    (REGEN, ["regenerate.batch_size=0"],
     "--set regenerate.batch_size=0: regenerate: max_new_tokens and batch_size must be positive"),
]


@pytest.mark.parametrize("config, overrides, message", BAD_SETS, ids=[" ".join(case[1]) for case in BAD_SETS])
def test_a_bad_set_is_refused_naming_it_before_anything_is_deployed(home, tmp_path, config, overrides, message):
    config = config or small_config(tmp_path / "small.yaml")
    result = cli("launch", "local", "--config", str(config), *sets(*overrides))
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert f"dflash: error: {message}" in result.stderr
    assert not home.exists()  # nothing deployed, no run


def test_an_error_of_the_file_is_the_files_even_beside_a_set_in_its_section(home, tmp_path):
    config = small_config(tmp_path / "small.yaml", optim={"epochs": 0})
    result = cli("launch", "local", "--config", str(config), *sets("optim.lr=1e-4"))
    assert result.exit_code == 2
    assert f"dflash: error: {config}: optim: lr and epochs must be positive" in result.stderr
    assert "--set" not in result.stderr and not home.exists()


# --- the resolved config ---------------------------------------------------------------------

@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_the_resolved_config_loads_back_to_the_same_config(path, tmp_path):
    config = load_job_config(path)
    text = resolved_yaml(config)
    (tmp_path / "resolved.yaml").write_text(text)
    again = load_job_config(tmp_path / "resolved.yaml")
    assert again == config and resolved_yaml(again) == text
    section = "regenerate" if config.job == "regenerate" else "runtime"
    assert all(f"\n  {name}:" in text for name in dataclass_fields(getattr(config, section)))  # every default


def dataclass_fields(section) -> list[str]:
    return list(dflash_schema.dump(section))


def test_strings_that_read_as_numbers_stay_strings_through_the_resolved_config(tmp_path):
    config = small_config(tmp_path / "c.yaml", drafter={"mask_token": "1e-4"})
    assert "mask_token: 1e-4" in config.read_text()  # written by plain PyYAML: unquoted
    with pytest.raises(dflash_schema.SchemaError, match="mask_token: expected a string, got a number"):
        load_job_config(config)  # our loader reads the file's 1e-4 as a number
    text = resolved_yaml(load_job_config(config, (dflash_schema.parse_override("drafter.mask_token='1e-4'"),)))
    (tmp_path / "resolved.yaml").write_text(text)
    assert "mask_token: '1e-4'" in text and load_job_config(tmp_path / "resolved.yaml").drafter.mask_token == "1e-4"


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=13, why="launches the real trainer on CPU")
def test_set_changes_what_the_trainer_runs_and_every_record_of_it(home, tmp_path):
    config = small_config(tmp_path / "small.yaml", devices={"target": ["cpu"], "drafters": ["cpu"]})
    overrides = ["optim.lr=1e-4", "drafter.num_layers=2", "optim.max_steps=3", "checkpoint.every=2",
                 "eval.at_start=false"]
    logs = tmp_path / "logs"
    done = dflash("--logs-dir", str(logs), "launch", "local", "--config", str(config), *sets(*overrides),
                  "--follow", cwd=tmp_path, env={"HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = done.stdout.splitlines()[0]
    run_dir = home / ".dflash" / "local" / "runs" / run_id

    # the run directory's config.yaml is the resolved config, the overrides in
    expected = load_job_config(config, tuple(map(dflash_schema.parse_override, overrides)))
    assert (expected.optim.lr, expected.drafter.num_layers) == (1e-4, 2)
    text = (run_dir / "config.yaml").read_text()
    assert text == resolved_yaml(expected) and load_job_config(run_dir / "config.yaml") == expected
    record = json.loads((run_dir / "run.json").read_text())
    assert record["overrides"] == overrides and record["config"] == text

    # the trainer ran it
    log = (run_dir / "train.log").read_text()
    assert "-> drafter (2 layers," in log and "step 3/3 " in log and " lr 1.00e-04 " in log
    steps = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and max(e["lr"] for e in steps) == pytest.approx(1e-4)
    assert json.loads((run_dir / "export" / "config.json").read_text())["num_hidden_layers"] == 2

    # every checkpoint carries it, covered by its SHA256SUMS
    for step in ("step_000002", "step_000003"):
        folder = run_dir / "checkpoints" / step
        assert (folder / "config.yaml").read_text() == text
        assert f"{hashlib.sha256(text.encode()).hexdigest()}  config.yaml\n" in (folder / "SHA256SUMS").read_text()

    # status --config prints it (data on stdout), the overrides on stderr; exit 0
    shown = cli("--logs-dir", str(logs), "status", "--config")
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout == text
    assert "overrides: --set optim.lr=1e-4 --set drafter.num_layers=2" in shown.stderr
    assert f"run {run_id} on local: SUCCEEDED" in shown.stderr
    as_json = json.loads(cli("--logs-dir", str(logs), "status", run_id, "--host", "local", "--config", "--json").stdout)
    assert as_json["config"] == text and as_json["overrides"] == overrides
    plain = cli("--logs-dir", str(logs), "status")
    assert plain.stdout == "SUCCEEDED\n" and "overrides: --set optim.lr=1e-4" in plain.stderr


# --- dflash --version --------------------------------------------------------------------------

def test_version_names_the_release_deploy_sends_without_loading_ssh(tmp_path):
    shown = dflash("--version", cwd=REPO, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert shown.returncode == 0, shown.stderr
    tree = release.scan(REPO)
    assert shown.stdout == f"dflash {metadata.version(DISTRIBUTION)}\nrelease {tree.release_id}\n"
    assert f"source: {REPO} (" in shown.stderr  # the line deploy prints
    imported = {line.rsplit("|", 1)[-1].strip() for line in shown.stderr.splitlines() if line.startswith("import time:")}
    assert "click" in imported and not {"fabric", "paramiko", "invoke"} & imported

    home = tmp_path / "home"
    deployed = dflash("deploy", "local", cwd=REPO, env={"HOME": str(home)})
    assert deployed.returncode == 0, deployed.stderr
    assert deployed.stdout.split("\t")[1] == tree.release_id
    assert (home / ".dflash" / "local" / "current").resolve().name == tree.release_id


@pytest.mark.parametrize("args", [["--help"], ["deploy", "--help"], ["hosts", "--help"], ["watch", "--help"]])
def test_help_loads_no_ssh_library(args):
    # the in-process SSH client (Fabric, paramiko, invoke) is imported only by a host it reaches
    shown = dflash(*args, cwd=REPO, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert shown.returncode == 0, shown.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in shown.stderr.splitlines() if line.startswith("import time:")}
    assert "click" in imported and not {"fabric", "paramiko", "invoke"} & imported


def test_version_outside_a_project_tree_names_the_copy_shipped_with_dflash(tmp_path):
    shown = dflash("--version", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.endswith(f"\nrelease {release.scan(release.project_root()).release_id}\n")
    assert "source: bundled with dflash" in shown.stderr
