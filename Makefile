# nac_fast: the two commands a newcomer needs on a fresh machine (see README.md).
#   make train   set up, then train NAC on the embedded Fashion-MNIST (torchrun, 2 CPU processes)
#                into OUT (runs/default); a second `make train` stops (status 2) without touching
#                the first run: ARGS=--resume continues it, OUT=runs/other trains another,
#                ARGS=--overwrite replaces it (README "Training")
#   make test    set up, then run the test suite (all of it: what CI runs), with the 15 slowest
#                tests listed at the end
#   make test-fast   the fast tier while working: the suite less the tests marked slow
#                (pytest -m "not slow": compile checks, packaging and install modes, torchrun
#                launches, the reproduction grid, large interpreter shapes), <= 5 minutes
# Setup is idempotent: a stamp in the venv records it; it re-runs when setup.py or csrc/ change.

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# What this machine's pip serves (CUDA 13.0 wheels); any torch>=2.4 works with the package.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# Installed before the package: pyproject.toml's [build-system] requires but torch (the extension
# is built against the venv's own torch, --no-build-isolation), and the test suite's and
# train.py's tools (tensorboard: train.py --tensorboard; scikit-learn: the digits of
# scripts/make_image_folder.py).  The [dev] extra lists the same tools (tests/test_packaging.py
# checks that each of them is here).
PY_DEPS    ?= "setuptools>=64" wheel ninja numpy Pillow tqdm pytest pytest-xdist matplotlib \
              faiss-cpu tensorboard scikit-learn nvidia-dali-cuda130
# pyproject.toml's extras installed with the package: dev (the tools above), dali (the dali-cpu
# loader runs in CI).
EXTRAS     ?= dev,dali
FMNIST_DIR := /usr/share/datasets/fashion-mnist
STAMP      := $(VENV)/.nac_fast_setup
ARGS       ?=
NPROC      ?= 2
# pytest worker processes (pytest-xdist), one per core; each test file runs whole on one worker
# (--dist loadfile: a file's module fixtures are built once) with one torch thread (conftest.py).
TEST_JOBS  ?= 2
PYTEST     := NAC_FAST_REQUIRE_EXT=1 $(BIN)/python -m pytest -q tests -n $(TEST_JOBS) --dist loadfile
OUT        ?= runs/default
export MAX_JOBS ?= 2

.PHONY: setup data test test-fast train bench clean

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml $(wildcard csrc/*) Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC) $(PY_DEPS)
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	@touch $(STAMP)

# Fashion-MNIST (real data, 60k/10k 28x28) from Debian's package: the embedded default data set.
data:
	@if [ ! -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	  else echo "Fashion-MNIST missing: run 'sudo apt-get install dataset-fashion-mnist'"; exit 1; fi; \
	fi

test: setup data
	$(PYTEST) --durations=15

test-fast: setup data
	$(PYTEST) -m "not slow" --durations=15

train: setup data
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py --out $(OUT) $(ARGS)

bench: setup
	$(BIN)/python bench/bench_loss.py $(ARGS)

clean:
	rm -rf build *.egg-info nac_fast/_C*.so
