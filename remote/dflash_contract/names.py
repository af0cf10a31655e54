"""Names and limits both halves must spell alike: environment variables a run sets, the
longest run id."""

# What the agent sets in a trainer's environment (dflash_agent/launch.py's trainer_env;
# docs/runs.md "Warm interpreter" says which of them a run may change).
RUN_ID_ENV = "DFLASH_RUN_ID"
ATTEMPT_ENV = "DFLASH_ATTEMPT"
RELEASE_ID_ENV = "DFLASH_RELEASE_ID"
RELEASE_DIR_ENV = "DFLASH_RELEASE_DIR"
WORKSPACE_ENV = "DFLASH_WORKSPACE"
# Where the CLI's own logs go: in the CLI's environment, so a `local` host's agent inherits it.
LOGS_ENV = "DFLASH_LOGS"

# What a run sets on top of the environment the warm interpreter started with: read while
# the trainer runs, never by an import. Every other variable must be the same (refused
# otherwise: an import may have read it).
RUN_TIME_ENV = frozenset((RUN_ID_ENV, ATTEMPT_ENV, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          # the state of the shell or session the agent was started from (`local`: the CLI's)
                          "PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLUMNS", "LINES", "SSH_CLIENT", "SSH_CONNECTION",
                          "SSH_TTY", "XDG_SESSION_ID", LOGS_ENV))

MAX_RUN_ID = 200  # characters; the CLI bounds run names by it, before deploying

# A run folder's files (docs/layout.md, runs/<run-id>/): the CLI mirrors the logs under
# the same names.
RUN_JSON = "run.json"
EXIT_JSON = "exit.json"
STOP_REQUESTED_JSON = "stop_requested.json"
RUN_CONFIG = "config.yaml"
TRAIN_LOG = "train.log"
AGENT_LOG = "agent.log"
EVENTS_JSONL = "events.jsonl"
ERRORS_JSONL = "errors.jsonl"
# The key of the abort record in a multi-host run's TCP store (docs/multihost.md).
ABORT_KEY = "abort"

# The packages dflash_train needs beyond the standard library (PyYAML, safetensors and
# numpy come with transformers); their distribution and module names are the same.
TRAINER_PACKAGES = ("torch", "transformers")
# How long a host's probes may take (the CLI waits for them as long, and then some).
NVIDIA_SMI_TIMEOUT_S = 15.0
IMPORT_TIMEOUT_S = 180.0  # a child interpreter importing torch and transformers
MODULE_CHECK_TIMEOUT_S = 60.0  # the trainer's interpreter finding the modules it needs
