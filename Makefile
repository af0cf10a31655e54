# Two entry points (README): `make demo` trains the tiny CPU config on the built-in
# `local` host end to end; `make test` runs the whole suite (what .ci/run calls).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast sshd

$(BIN)/dflash: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[train,test]'
	touch $(BIN)/dflash

setup: $(BIN)/dflash

demo: setup
	$(BIN)/dflash launch local --config configs/train/tiny-cpu.yaml --follow

# The tests start their own OpenSSH server on 127.0.0.1 from Debian's openssh-server.
sshd:
	@test -x /usr/sbin/sshd || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q openssh-server; }

# Four workers on 2 cores: many tests wait (on subprocesses, sshd, a trainer's heartbeat or
# its stall), so twice as many workers as cores keep both cores busy (measured: 3 workers
# left a third of the cores' time idle). loadgroup: the tests of one xdist_group (those
# sharing an expensive module fixture) run on one worker; every other test goes to
# whichever worker is free, the slow ones first, the longest first. Session fixtures are
# per worker (tests/conftest.py).
TEST_WORKERS ?= 4
test: setup sshd
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

# The suite less the tests marked slow (trainer processes, compiles, installs: each one
# states its cost and why in its @pytest.mark.slow): the loop to run while changing code.
test-fast: setup sshd
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m 'not slow' tests
