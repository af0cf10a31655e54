"""The strict loader and the host inventory: every bad input names file, host and key."""
from __future__ import annotations

import dataclasses
import sys
import textwrap
from typing import Literal, Mapping

import pytest

import dflash_schema
from dflash_cli.errors import DflashError, ExitCode
from dflash_cli.inventory import load_inventory


def write(tmp_path, text: str):
    path = tmp_path / "hosts.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_builtin_local_exists_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_HOSTS", raising=False)
    inventory = load_inventory()
    assert list(inventory.hosts) == ["local"]
    local = inventory.get("local")
    # The interpreter running dflash has the trainer's packages; python3 on PATH may not.
    assert (local.transport, local.python) == ("local", sys.executable)


def test_full_pct_entry_loads(tmp_path):
    path = write(tmp_path, """
        hosts:
          ct200:
            transport: pct
            ssh: root@10.1.2.6
            container: 200
            workspace: /workspace/dflash
            python: python3
            identity_file: ~/.ssh/id_ed25519
            known_hosts: ~/.ssh/known_hosts
            env: {HF_HOME: /workspace/hf}
    """)
    host = load_inventory(path).get("ct200")
    assert (host.name, host.container, host.env["HF_HOME"]) == ("ct200", 200, "/workspace/hf")
    assert load_inventory(path).get("local").python == sys.executable
    assert load_inventory(path).get("local").workspace == "~/.dflash/local"


@pytest.mark.parametrize("body, expected", [
    ("ct200: {transport: pct, ssh: root@n, container: 200, workspace: /w, colour: red}",
     "hosts.ct200.colour: unknown key"),
    ("ct200: {transport: pct, ssh: root@n, container: '200', workspace: /w}",
     "hosts.ct200.container: expected an integer, got a string '200'"),
    ("ct200: {transport: pct, ssh: root@n, container: 200}",
     "hosts.ct200.workspace: missing required key"),
    ("ct200: {transport: pct, ssh: root@n, workspace: /w}",
     "hosts.ct200: transport pct needs the key 'container'"),
    ("box: {transport: rsh, ssh: root@n, workspace: /w}",
     "hosts.box.transport: expected one of 'local' | 'ssh' | 'pct', got 'rsh'"),
    ("box: {transport: ssh, workspace: /w, env: {A: 1}}",
     "hosts.box.env.A: expected a string, got an integer 1"),
    ("box: {transport: ssh, ssh: root@n, workspace: /w, host_key: yes-please}",
     "hosts.box.host_key: expected one of 'strict' | 'accept-new'"),
])
def test_bad_entries_name_file_host_and_key(tmp_path, body, expected):
    path = write(tmp_path, "hosts:\n  " + body + "\n")
    with pytest.raises(DflashError) as info:
        load_inventory(path)
    assert info.value.exit_code == ExitCode.USAGE
    assert info.value.message.startswith(f"{path}: ")
    assert expected in info.value.message


def test_yaml_syntax_error_and_missing_file(tmp_path):
    path = write(tmp_path, "hosts: {a: [\n")
    with pytest.raises(DflashError, match="invalid YAML"):
        load_inventory(path)
    with pytest.raises(DflashError, match="inventory file not found"):
        load_inventory(tmp_path / "nope.yaml")


def test_unknown_host_lists_the_known_ones(tmp_path):
    path = write(tmp_path, "hosts:\n  box: {transport: ssh, ssh: root@n, workspace: /w}\n")
    with pytest.raises(DflashError, match=r"unknown host 'gpu9' \(known hosts: box, local\)"):
        load_inventory(path).get("gpu9")


def test_loader_types_are_strict():
    @dataclasses.dataclass(frozen=True)
    class Part:
        rate: float = 1.0
        on: bool = False
        mode: Literal["a", "b"] = "a"
        sizes: tuple[int, ...] = ()
        extra: Mapping[str, int] = dataclasses.field(default_factory=dict)

    assert dflash_schema.load(Part, {"rate": 2, "sizes": [1, 2]}, "x.yaml") == Part(rate=2.0, sizes=(1, 2))
    for bad, where in [({"on": 1}, "on"), ({"rate": True}, "rate"), ({"sizes": [1, "2"]}, "sizes[1]"),
                       ({"mode": "c"}, "mode"), ({"extra": {"k": 1.5}}, "extra.k"), ([], "")]:
        with pytest.raises(dflash_schema.SchemaError) as info:
            dflash_schema.load(Part, bad, "x.yaml")
        assert info.value.where == where


def test_a_host_given_twice_is_refused_naming_file_line_and_name(tmp_path):
    path = write(tmp_path, """
        hosts:
          ct200: {transport: pct, ssh: root@n, container: 200, workspace: /w}
          box: {transport: ssh, ssh: root@n, workspace: /w}
          ct200: {transport: pct, ssh: root@n, container: 201, workspace: /w}
    """)
    with pytest.raises(DflashError) as info:
        load_inventory(path)
    assert info.value.exit_code == ExitCode.USAGE
    assert info.value.message == f"{path}: line 5: key 'ct200' given twice (first at line 3)"


@pytest.mark.parametrize("text, line, key", [
    ("hosts:\n  box:\n    transport: ssh\n    ssh: root@n\n    workspace: /w\n    ssh: root@m\n", 6, "ssh"),
    ("hosts:\n  box: {transport: ssh, ssh: root@n, workspace: /w, env: {A: '1', A: '2'}}\n", 2, "A"),
    ("a:\n  - {x: 1}\n  - {y: 1,\n     y: 2}\n", 4, "y"),
])
def test_keys_given_twice_are_refused_at_any_depth(tmp_path, text, line, key):
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(dflash_schema.SchemaError, match=rf"^{path}: line {line}: key '{key}' given twice"):
        dflash_schema.read_yaml(path)


def test_a_merged_key_may_be_overridden(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("base: &base {a: 1, b: 2}\nhere:\n  <<: *base\n  a: 3\n")
    assert dflash_schema.read_yaml(path)["here"] == {"a": 3, "b": 2}


@dataclasses.dataclass(frozen=True)
class _Inner:
    scale: float = 1.0
    limits: tuple[float, ...] = ()
    cap: float | None = None
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Outer:
    rate: float = 1.0
    inner: _Inner = _Inner()


@pytest.mark.parametrize("spelling, shown", [(".inf", ".inf"), ("-.inf", "-.inf"), (".nan", ".nan"),
                                              (".Inf", ".inf"), ("-.INF", "-.inf"), (".NaN", ".nan"),
                                              ("1.0e+400", ".inf")])
@pytest.mark.parametrize("template, where", [("rate: {}", "rate"), ("inner: {{scale: {}}}", "inner.scale"),
                                             ("inner: {{limits: [0.5, {}]}}", "inner.limits[1]"),
                                             ("inner: {{cap: {}}}", "inner.cap"),
                                             ("inner: {{weights: {{a: 1, b: {}}}}}", "inner.weights.b")])
def test_loader_refuses_non_finite_floats_at_any_depth(tmp_path, spelling, shown, template, where):
    path = tmp_path / "x.yaml"
    path.write_text(template.format(spelling) + "\n")
    with pytest.raises(dflash_schema.SchemaError) as info:
        dflash_schema.load_file(_Outer, path)
    assert info.value.where == where
    assert str(info.value) == f"{path}: {where}: expected a finite number, got {shown}"


def test_loader_refuses_an_int_beyond_the_float_range(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(f"rate: {10**400}\n")
    with pytest.raises(dflash_schema.SchemaError, match=r"x\.yaml: rate: expected a finite number, got 1000"):
        dflash_schema.load_file(_Outer, path)


def test_loader_keeps_finite_floats(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("rate: 1.0e+30\ninner: {scale: -2, limits: [0.0, -1.5e-300], cap: 3.5, weights: {a: 1.0e+3}}\n")
    loaded = dflash_schema.load_file(_Outer, path)
    assert loaded == _Outer(rate=1e30, inner=_Inner(scale=-2.0, limits=(0.0, -1.5e-300), cap=3.5,
                                                    weights={"a": 1000.0}))
