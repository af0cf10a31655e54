"""dflash launch: validate a training config here, deploy if needed, start the run there."""
from __future__ import annotations

import datetime
import json
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import dflash_schema
from dflash_agent.gpus import TRAINER_PACKAGES
from dflash_agent.layout import MAX_RUN_ID

from .. import console
from ..errors import DflashError, ExitCode
from ..local_state import RunRef, set_latest
from ..release import Release
from ..release_store import ReleaseStore
from ..session import Session
from . import deploy, status

if TYPE_CHECKING:
    from dflash_train.config import TrainConfig

_BAD_NAME = re.compile(r"[/\x00-\x1f\x7f]")


def load_config(path: Path, overrides: tuple[str, ...] = ()) -> TrainConfig:
    """The training config with the `--set KEY=VALUE` overrides merged in, checked by the
    trainer's own schema before anything is sent."""
    from dflash_train.config import load_train_config  # torch-free by contract

    try:
        return load_train_config(path, tuple(map(dflash_schema.parse_override, overrides)))
    except dflash_schema.SchemaError as exc:
        raise DflashError(str(exc), ExitCode.USAGE) from exc


def new_run_id(name: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


# The run id is the name plus a stamp; the agent refuses ids longer than MAX_RUN_ID.
MAX_NAME = MAX_RUN_ID - len(new_run_id(""))


def check_name(name: str) -> None:
    """A run name becomes the start of a run id: one path component on the host, and an
    argument of later commands (`dflash watch RUN`), so it may not look like an option."""
    if not name.strip() or name[0] in ".-" or _BAD_NAME.search(name) or len(name) > MAX_NAME:
        raise DflashError(f"--name {name!r}: a run name has 1 to {MAX_NAME} characters, does not start "
                          "with '.' or '-', and holds no '/' or control characters", ExitCode.USAGE)


def host_paths(config: TrainConfig) -> list[tuple[str, str, str]]:
    """(kind, key, path) of every path in the config, for the agent to check on the host
    (the agent's --require-path: a file, a model folder or hub id, a checkpoint)."""
    paths = []
    if config.target.path is not None:
        paths.append(("model", "target.path", config.target.path))
    for key in ("train", "eval"):
        if config.data is not None and getattr(config.data, key) is not None:
            paths.append(("file", f"data.{key}", getattr(config.data, key)))
    if config.regenerate is not None:
        paths.append(("file", "regenerate.prompts", config.regenerate.prompts))
    if config.evaluate is not None:
        paths.append(("model", "evaluate.drafter", config.evaluate.drafter))
        if config.evaluate.prompts is not None:
            paths.append(("file", "evaluate.prompts", config.evaluate.prompts))
    if config.checkpoint.resume not in (None, "latest"):
        paths.append(("checkpoint", "checkpoint.resume", config.checkpoint.resume))
    return paths


def say_what_is_new(session: Session, host_name: str, tree: Release) -> None:
    """One line: what this release changed since the newest run on the host, so the same
    patch is not launched twice by mistake (nothing before the host's first run)."""
    runs = session.agent(host_name).call("status")["runs"]
    previous = next((r for r in runs if r.get("release_id")), None)
    if previous is None:
        return
    store = ReleaseStore(session)
    store.add_local(tree)
    console.say(f"{host_name}: {status.change_since(store, host_name, previous, tree.release_id)['text']}")


def run(session: Session, host_name: str, config_path: Path, name: str | None,
        force: bool, source_dir: Path | None, overrides: tuple[str, ...] = (),
        allow_large: bool = False) -> RunRef:
    """Start a run; returns its reference (the CLI prints the run id on stdout). The host
    gets the resolved config (every default filled in, `overrides` applied), which the
    trainer loads through the same schema again."""
    from dflash_train.config import resolved_yaml

    name = config_path.stem if name is None else name
    check_name(name)
    host = session.host(host_name)
    config = load_config(config_path, overrides)
    tree, source = deploy.source_tree(source_dir, allow_large)
    with deploy.upload_bars() as bars, deploy.cancel_on_ctrl_c() as cancel:
        result = deploy.deploy_host(session, host, tree, bars, cancel=cancel)
    if cancel.is_set():  # Ctrl-C came after the host had switched: say so, start nothing
        raise DflashError(f"{host.name}: interrupted; release {result.release_id} is live ({result.status} "
                          "before the interrupt took effect); no run was started", ExitCode.INTERRUPTED)
    if result.status != "unchanged":
        console.say(f"{host.name}: release {result.release_id} {result.status} "
                    f"({result.files_sent} files sent)")
    say_what_is_new(session, host.name, tree)
    run_id = new_run_id(name)
    # Every value in the option's own word (--key=value): none can read as an option.
    args = [f"--run-id={run_id}", "--config=-", f"--name={name}", f"--stall-after={config.stall_after}",
            f"--source-json={json.dumps(source)}", f"--restart-json={json.dumps(config.restart.as_json())}"]
    args += [f"--resource={resource}" for resource in config.resources()]
    args += [f"--env={key}={value}" for key, value in host.env.items()]
    args += [f"--require-module={package}" for package in TRAINER_PACKAGES]
    args += [f"--require-path={kind}:{key}={path}" for kind, key, path in host_paths(config)]
    args += [f"--override={override}" for override in overrides]
    if force:
        args.append("--force")
    reply = session.agent(host.name).call("launch", *args, stdin=resolved_yaml(config).encode())
    ref = RunRef(host.name, reply["run_id"])
    set_latest(session.logs_dir, ref)
    console.say(f"{host.name}: started run {ref.run_id} (pid {reply.get('pid')}, "
                f"release {reply.get('release_id')})")
    return ref
