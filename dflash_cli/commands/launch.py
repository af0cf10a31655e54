"""dflash launch: validate a training config here, deploy if needed, start the run there."""
from __future__ import annotations

import datetime
import json
import re
import secrets
from pathlib import Path

import dflash_schema

from .. import console
from ..errors import DflashError, ExitCode
from ..local_state import RunRef, set_latest
from ..session import Session
from . import deploy

_BAD_NAME = re.compile(r"[/\x00-\x1f]")


def load_config(path: Path):
    """The training config, checked by the trainer's own schema before anything is sent."""
    from dflash_train.config import load_train_config  # torch-free by contract

    try:
        return load_train_config(path)
    except dflash_schema.SchemaError as exc:
        raise DflashError(str(exc), ExitCode.USAGE) from exc


def new_run_id(name: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def run(session: Session, host_name: str, config_path: Path, name: str | None,
        force: bool, source_dir: Path | None) -> RunRef:
    """Start a run; returns its reference (the CLI prints the run id on stdout)."""
    host = session.host(host_name)
    config = load_config(config_path)
    name = name or config_path.stem
    if _BAD_NAME.search(name) or name.startswith(".") or not name.strip():
        raise DflashError(f"--name {name!r}: a run name may not start with '.', be blank, "
                          "or hold '/' or control characters", ExitCode.USAGE)
    tree, source = deploy.source_tree(source_dir)
    with deploy.upload_bars() as bars:
        result = deploy.deploy_host(session, host, tree, bars)
    if result.status != "unchanged":
        console.say(f"{host.name}: release {result.release_id} {result.status} "
                    f"({result.files_sent} files sent)")
    run_id = new_run_id(name)
    args = ["--run-id", run_id, "--config", "-", "--name", name,
            "--stall-after", str(config.stall_after), f"--source-json={json.dumps(source)}"]
    for resource in config.resources():
        args += ["--resource", resource]
    for key, value in host.env.items():
        args += ["--env", f"{key}={value}"]
    if force:
        args.append("--force")
    reply = session.agent(host.name).call("launch", *args, stdin=config_path.read_bytes())
    ref = RunRef(host.name, reply["run_id"])
    set_latest(session.logs_dir, ref)
    console.say(f"{host.name}: started run {ref.run_id} (pid {reply.get('pid')}, "
                f"release {reply.get('release_id')})")
    return ref
