"""dflash agent: launches, supervises and reports on runs on a host. Stdlib only.

Shipped in every release as remote/dflash_agent with the launcher remote/agent.py.
The CLI runs it as one argv (quoted once by the transport):

    <python> <workspace>/current/remote/agent.py --workspace <workspace> VERB [options]

Every verb but `follow` prints exactly one JSON object on stdout and exits 0; on a
problem it prints {"error": "<message>", "kind": "<usage|not_found|conflict|internal>"}
and exits 2 (usage/conflict/not_found) or 1 (internal); an error may carry more keys
(a lock conflict adds "holder": the run id holding it, and "resource"). stderr is
free-form; --help goes to stderr too.

Verbs
-----
launch   --run-id ID --config PATH [--name NAME] [--resource R]... [--force]
         [--env KEY=VALUE]... [--python EXE] [--stall-after S=300]
         Creates runs/ID/, copies the config to runs/ID/config.yaml (a relative PATH
         is read from the release root; "-" reads the config from stdin), takes the locks
         for its resources (GPU indices as "gpu0", "gpu1", or "cpu" for a CPU-only run;
         a lock held by a non-terminal run -> kind "conflict" naming that run, unless
         --force), then starts a supervisor in a new session (setsid; stdin /dev/null;
         its own stderr to runs/ID/agent.log). The supervisor forks the trainer in
         another new session, writes run.json (run id, release id, config, argv, pid,
         pgid, process start time, boot id, host, started_at, stall_after) *before*
         letting the child exec `python -m dflash_train --config runs/ID/config.yaml
         --run-dir runs/ID` with cwd runs/ID, PYTHONPATH=<release>/remote,
         PYTHONUNBUFFERED=1, PYTHONDONTWRITEBYTECODE=1, DFLASH_RUN_ID, DFLASH_RELEASE_ID, DFLASH_RELEASE_DIR (the
         release root), DFLASH_WORKSPACE, the --env pairs, stdout+stderr appended to
         runs/ID/train.log. The release is the one `current` points to at launch,
         resolved (runs keep their release even when `current` moves on). When the
         trainer ends it writes exit.json {exit_code, signal, oom_killed, ended_at,
         exec_error} atomically (exec_error: null, or why the exec failed; exit_code
         is then 127 and train.log holds the reason). run.json also records name,
         release_dir, workspace, config_source, cwd, env_keys (the --env keys; values
         are not recorded), resources, start_time (/proc stat field 22) and
         supervisor {pid, start_time}. `launch` returns after run.json exists:
         {"run_id", "run_dir", "pid", "pgid", "release_id"}.
status   [--run-id ID]    {"runs": [RunStatus...]} (all runs if no id; newest first)
         RunStatus = {"run_id", "name", "state", "pid", "started_at", "ended_at",
                      "exit": exit.json or null, "errors": n_records,
                      "last_heartbeat": ts or null, "release_id", "step": last step or null}
stop     --run-id ID [--grace S=10]
         Writes stop_requested.json, SIGTERM to the trainer's process group, waits
         `grace`, SIGKILL, and returns only when no process of the group is left and
         exit.json exists: {"run_id", "state", "killed": bool}.
stacks   --run-id ID [--timeout S=5]
         SIGUSR1 to the trainer (faulthandler dumps all threads into
         faulthandler.log); returns {"run_id", "text": the new dump}. Refused (kind
         "conflict") when the trainer is not running or has no SIGUSR1 handler yet,
         whose default action would kill it.
report   --run-id ID [--log-lines N=200]
         Everything fetch-traceback needs: {"run_id", "state", "run": run.json,
         "exit": exit.json|null, "errors": [records...], "faulthandler": text,
         "log_tail": last N lines of train.log}. A record line that is not JSON is
         given as {"raw": text}.
gpus     {"gpus": [{"index", "name", "memory_used_mib", "memory_total_mib",
          "utilization_pct", "temperature_c", "power_w"}]} ([] without nvidia-smi;
          plus "problem": text when nvidia-smi exists but fails).
info     {"python", "platform", "hostname", "boot_id", "packages": {"torch": v|null,
          "transformers": v|null}, "gpus": [...], "current_release": id|null,
          "python_executable"} (+ "gpus_problem" as for gpus)
follow   --run-id ID [--offset N] [--inode I] [--errors-seen K] [--tail-lines N]
         [--gpu-interval S=5 (0: none)] [--poll S=0.1]
         Streams JSON lines, flushed one by one, until the run is terminal and
         everything was sent:
           {"t": "log", "offset": start_byte, "data": text}   (+ "inode": I in the first)
               whole lines only (a partial last line is held until it completes or
               the run ends); data is utf-8 decoded with surrogateescape, so
               data.encode("utf-8", "surrogateescape") gives the exact bytes and
               offset + their length is where the next message starts. Lines are
               batched for up to 1 s (the wire stays near the log's own size); the
               lines before an error record are sent at once, with it.
           {"t": "error", "index": k, "record": errors.jsonl record}
           {"t": "gpu", "ts": ..., "gpus": [...]}          (none without nvidia-smi)
           {"t": "state", "state": "RUNNING", "ts": ...}    on every state change
           {"t": "end", "state": "FAILED", "exit": exit.json|null, "offset": N}
         An error line that is not JSON comes as {"t": "error", "index", "record":
         null, "raw": text}. Log lines of a chatty run are batched (at most one log
         message per 0.5 s) except right before an error record and at the end.
         When the reader goes away (EPIPE, or its pipe reports an error even while
         the run is quiet) follow exits 0 without a word; the run goes on.
         --tail-lines N starts at the last N lines (found by reading backwards from the
         end, so the cost does not depend on the log's size); --offset/--inode resume
         (a different inode restarts from 0); --errors-seen skips records already
         received.

Run states (DESIGN.md): STARTING, RUNNING, SUCCEEDED, FAILED, STOPPED, DEGRADED,
STALLED, LOST, derived from run.json + exit.json + errors.jsonl + stop_requested.json
+ events.jsonl heartbeats + /proc, never from the end of a stream.
"""
