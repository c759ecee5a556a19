# Two commands do all set-up on a fresh machine (README): `make serve` and `make test`.
# The first install builds llama-cpp-python from source (~7 min on 2 cores), once per machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKERS ?= 2  # pytest-xdist workers for test-fast (CI's `make test` stays serial: steadier timings)

.PHONY: serve chat test test-fast demo bench-serve bench-agent bench-learning bench-hints bench-judge bench-train bench-tui bench-mlx

# llama.cpp's native build uses every instruction the CPU reports. Some containers forbid AMX
# although the CPU reports it, and the daemon then dies with "Illegal instruction" at its first
# reply (seen on this project's CI). AMX only speeds up prompt batches on recent Xeons, so where
# the CPU has it the build leaves it out and stays native otherwise. Through CFLAGS, so that a
# CMAKE_ARGS of your own (CUDA, Metal) passes through untouched.
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
NO_AMX := $(if $(shell grep -qs amx_tile /proc/cpuinfo && echo y),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
# pip's cache keys a built wheel by its source only, so it could hand back one built with AMX or
# for another CPU (a shared home): ours lives in a folder named after the flags and the CPU.
LLAMA_KEY := $(shell { printf '%s|%s|' "$$CMAKE_ARGS" "$(NO_AMX)"; grep -m1 -s '^flags' /proc/cpuinfo || sysctl -n machdep.cpu.brand_string; } 2>/dev/null | cksum | cut -d' ' -f1)
LLAMA_WHEELS := $(HOME)/.cache/clawd/wheels/llama-cpp-python-$(LLAMA_VERSION)-$(LLAMA_KEY)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { rm -rf $(LLAMA_WHEELS).part && \
	  CFLAGS="$(NO_AMX) $$CFLAGS" CXXFLAGS="$(NO_AMX) $$CXXFLAGS" $(PY) -m pip wheel --quiet --no-deps \
	    --no-cache-dir --wheel-dir $(LLAMA_WHEELS).part llama-cpp-python==$(LLAMA_VERSION) && \
	  rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).part $(LLAMA_WHEELS); }
	$(PY) -m pip install --quiet --find-links $(LLAMA_WHEELS) --only-binary llama-cpp-python -e ".[test]"
	touch $(STAMP)

serve: $(STAMP)  ## run the daemon on the embedded Gemma 3 270M model
	$(VENV)/bin/clawd serve

chat: $(STAMP)  ## open the TUI (offers to start the daemon if it is not running)
	$(VENV)/bin/clawd chat

test: $(STAMP)  ## every test, the real-model (slow) ones included, as CI runs them
	$(PY) -m pytest -m "slow or not slow"

test-fast: $(STAMP)  ## the quick loop: everything but the real-model tests and repeated training runs, on both cores
	$(PY) -m pytest -n $(WORKERS)

demo: $(STAMP)  ## teach the embedded model one correction, show the change, roll it back
	$(PY) examples/learn_a_correction.py

bench-serve: $(STAMP)  ## serving speed through the daemon vs raw llama-cpp-python
	$(PY) benchmarks/serve.py

bench-agent: $(STAMP)  ## agent-sized prompts (~6k-token preamble + tools): TTFT per turn, clawd vs llama_cpp.server (ARGS=--model PATH)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/agent_prompt.py $(ARGS)

bench-learning: $(STAMP)  ## simulated users: does it learn their preference? hybrid vs RL vs OPD (~25 min; ARGS=... to change)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/learning.py $(ARGS)

bench-hints: $(STAMP)  ## does the hinted teacher (base + the user's correction) comply? per hint wording and source (ARGS="--hint-source raw,judge --model PATH")
	$(PY) benchmarks/hint_wording.py $(ARGS)

bench-judge: $(STAMP)  ## the judges on the labelled next-state corpus: correction recall, inverted verdicts, hints (ARGS=... e.g. --judge rules)
	$(PY) -m clawd.cli bench judge $(ARGS)

bench-tui: $(STAMP)  ## TUI start-up to the first screen vs a bare Textual app (goal < 1 s)
	$(PY) benchmarks/tui_startup.py

bench-mlx: $(STAMP)  ## mlx engine vs llama.cpp engine on the 270M model: generation tok/s, adapter swap ms (~2 min)
	$(PY) benchmarks/mlx_engine.py $(ARGS)

bench-train: $(STAMP)  ## training step: clawd's hybrid step vs an mlx_lm SFT step, BLAS, memory (~6 min)
	$(PY) benchmarks/train.py
