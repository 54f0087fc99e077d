# FlashAttention from First Principles — every command a learner or an instructor needs.
# `make help` lists them. PYTHON is the course's environment (.venv) once `make setup` has made it,
# else the python3 on PATH (as on a GPU machine whose image already holds torch and triton).

VENV       ?= .venv
PYTHON     ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
,          := ,
PINNED     ?= 1
# the interpreter `make setup` builds the venv from (the pinned packages need Python 3.11 to 3.14)
PY3        ?= python3
EXTRAS     := $(if $(filter 1,$(PINNED)),course$(,)pinned,course)
JOBS       ?= 2
# test-gpu's pytest workers: compiling kernels is CPU-bound, so all cores but two (at most 14), and one per
# 12 GiB of GPU memory at most (course_lib.runtime.gpu_test_workers).
GPU_JOBS   ?= $(shell $(PYTHON) -c "from course_lib.runtime import gpu_test_workers; print(gpu_test_workers())" 2>/dev/null || echo 4)
# test-gpu runs this many notebooks at a time (their timings are then contended, so not recorded).
NB_JOBS    ?= 3
LAB_ARGS   ?=
STUDENT    := build/student
# make test's files in the order its two workers take them (--dist loadfile: whole files; --no-loadscope-reorder:
# in this order, where xdist's own puts the files with the most tests first, and so the four browser tests and the
# compile check, about 2 minutes of one worker, last): the notebooks, the longest test files, the rest by name
SLOW_TESTS := $(wildcard $(addprefix tests/test_,browser.py integrations.py compile_check.py models.py decode_heuristics.py \
	attention_variants.py sliding_window.py varlen.py paged.py))
TEST_FILES := $(SLOW_TESTS) $(filter-out $(SLOW_TESTS),$(sort $(wildcard tests/test_*.py)))
VERIFY     := build/verify
# threads per test process: the cores shared out among the JOBS workers (two workers of two threads each on a
# 2-core machine ran slower than one thread each)
THREADS    ?= $(shell $(PYTHON) -c "import os; print(max(1, (os.cpu_count() or 1) // $(JOBS)))" 2>/dev/null || echo 1)
NOTEBOOK_DIR ?= notebooks
NBVAL      := --nbval-lax --nbval-current-env --nbval-cell-timeout=900 --nbval-kernel-startup-timeout=300 --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: help setup lab lab-student test test-gpu bench bench-decode lint format notebooks student student-reset grade doctor clean

help:
	@echo "make setup     create $(VENV) with the pinned course environment (PINNED=0 keeps your own torch/triton)"
	@echo "make lab       open the course in JupyterLab (instructor edition: solutions filled in)"
	@echo "make lab-student  build the student edition (exercises blank) and open it (= make lab EDITION=student)"
	@echo "make grade     run your notebooks in $(STUDENT)/ headless and print a scorecard (NB=06 for one; DIR=notebooks for the instructor edition)"
	@echo "make doctor    report versions and device; fail on known-bad combinations"
	@echo "make test      CPU: course_lib tests, and every notebook under nbval (the student edition, each answer checked)"
	@echo "make test-gpu  CUDA GPU: the tests with compiled kernels and GPU sizes, then every notebook"
	@echo "make bench     benchmark course_lib against PyTorch (BENCH=attention|host_time|decode|fused|train|serving|speculative for one); records to assets/benchmarks/"
	@echo "make bench-decode  the decoding benchmark alone (split-KV and paged vs SDPA)"
	@echo "make lint      ruff, and notebooks in sync with their sources and free of outputs"
	@echo "make notebooks regenerate notebooks/*.ipynb from their sources notebooks/*.py"
	@echo "make student   write the student edition (solutions removed) to $(STUDENT)/; never overwrites your saved work"
	@echo "make student-reset NB=06  start notebook 06 of the student edition over (your copy is backed up first)"
	@echo "make format    ruff format course_lib and tests, then ruff check --fix (notebooks too)"
	@echo "make clean     remove what the tests build (build/verify, notebook logs) and .pytest_cache; never $(STUDENT)/"

# the free disk space `make setup` asks for where $(VENV) goes, in GiB: the CPU environment takes about
# 2.5 GB (torch's CUDA build several more). PINNED=0 reuses the system's torch and needs little, so it
# is not checked; neither is a machine without $(PY3) (conda brings its own Python).
SETUP_DISK_GB ?= 3

setup:
	@echo "==> make setup: creating the course environment in $(VENV)"
	@if { [ "$(PINNED)" != "0" ] || [ "$(USE_CONDA)" = "1" ]; } && command -v $(PY3) >/dev/null 2>&1; then \
		$(PY3) -c 'import os, shutil, sys; d = os.path.dirname(os.path.abspath(sys.argv[1])); free = shutil.disk_usage(d).free / 2**30; need = float(sys.argv[2]); free >= need or sys.exit(f"make setup: {free:.1f} GiB free on the disk of {d}, and the course environment needs about {need:g} GiB (torch, triton, JupyterLab; the CUDA build of torch several more). Free some space, or put the environment on a roomier disk by passing VENV=/path/to/venv to every make command.")' "$(VENV)" "$(SETUP_DISK_GB)"; \
	fi
	@if [ "$(USE_CONDA)" = "1" ]; then \
		if ! command -v conda >/dev/null 2>&1; then \
			echo "make setup: USE_CONDA=1 but conda is not on PATH (install Miniforge or Miniconda, or run make setup without USE_CONDA)" >&2; \
			exit 1; \
		fi; \
		echo "    USE_CONDA=1: conda env create -p $(VENV) -f environment.yml"; \
		conda env create -p $(VENV) -f environment.yml --yes; \
	else \
		if [ "$(PINNED)" != "0" ] && ! $(PY3) -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then \
			echo "make setup: the pinned packages need Python 3.11 to 3.14, and $(PY3) is $$($(PY3) -V 2>&1)." >&2; \
			echo "  Name another interpreter (make setup PY3=python3.12), let conda bring one (USE_CONDA=1), or install" >&2; \
			echo "  on version ranges with the torch/triton you have (PINNED=0)." >&2; \
			exit 1; \
		fi; \
		echo "    $(PY3) -m venv $(if $(filter 0,$(PINNED)),--system-site-packages ,)$(VENV), then pip install -e .[$(EXTRAS)]"; \
		$(PY3) -m venv $(if $(filter 0,$(PINNED)),--system-site-packages,) $(VENV) && \
		$(VENV)/bin/python -m pip install --quiet --upgrade pip && \
		$(VENV)/bin/python -m pip install --quiet -e ".[$(EXTRAS)]"; \
	fi
	@$(VENV)/bin/python -m course_lib doctor
	@$(VENV)/bin/python -m course_lib.attention.precompile --setup
	@echo "==> done. Next: make lab   (or: make test)"

# make lab: the instructor edition (notebooks/, solved, paired with the .py sources for authors);
# make lab EDITION=student or make lab-student: the student edition, rebuilt into $(STUDENT)/ first.
EDITION    ?= instructor
LAB_DIR     = $(if $(filter student,$(EDITION)),$(STUDENT),$(NOTEBOOK_DIR))
ALLOW_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)

lab: $(if $(filter student,$(EDITION)),student,)
	@echo "==> make lab: JupyterLab on $(LAB_DIR)/, the $(EDITION) edition (start with 00_setup.ipynb)"
	@$(if $(ALLOW_ROOT),echo "    running as root (a container?): passing --allow-root (JupyterLab refuses root without it)",true)
	$(PYTHON) -m jupyter lab --notebook-dir=$(LAB_DIR) $(ALLOW_ROOT) $(LAB_ARGS)

lab-student:
	@$(MAKE) --no-print-directory lab EDITION=student

doctor:
	@$(PYTHON) -m course_lib doctor

# The student edition lives where students save their work: building it again writes only what is missing or
# what the student never changed (course_lib.tools.notebooks student); student-reset starts one over, backed up.
student:
	@echo "==> make student: the student edition in $(STUDENT)/ (your saved work is kept)"
	@$(PYTHON) -m course_lib.tools.notebooks student $(STUDENT)

NB ?=
student-reset:
	@$(PYTHON) -m course_lib.tools.notebooks reset $(STUDENT) $(NB)

DIR ?= $(STUDENT)
grade: $(if $(filter $(STUDENT),$(DIR)),student,)
	@echo "==> make grade: running the notebooks of $(DIR)/ headless (a copy: your files are not written)"
	@$(PYTHON) -m course_lib grade --dir $(DIR) $(NB)

# The notebooks run once, as the verification edition: the student edition (exercises blank, predictions
# blank) with each instructor answer run after its check cell in a copy of the namespace
# (course_lib.tools.verify). It shows that the student edition runs to the end and that every answer passes.
# COURSE_STRICT_FIGURES=1: a figure wider than JupyterLab's column at 1366x768, or with text under 9 pt, fails
# its cell (course_lib.perf.plotting). The files run in TEST_FILES' order (above).
test:
	@echo "==> make test: doctor, then course_lib tests + every notebook under nbval ($(JOBS) workers, $(THREADS) thread(s) each, CPU)"
	@$(PYTHON) -m course_lib doctor
	@rm -rf $(VERIFY)
	@$(PYTHON) -m course_lib.tools.notebooks verify $(VERIFY) > /dev/null
	COURSE_STRICT_FIGURES=1 COURSE_DEVICE=cpu OMP_NUM_THREADS=$(THREADS) $(PYTHON) -m pytest -q -n $(JOBS) \
		--dist loadfile --no-loadscope-reorder --durations=20 \
		-m "not gpu" $(NBVAL) $(VERIFY) $(TEST_FILES)

test-gpu:
	@echo "==> make test-gpu: course_lib tests on the GPU ($(GPU_JOBS) processes: compiling kernels is CPU-bound; fewer where GPU memory is short), then every notebook ($(NB_JOBS) at a time, records in assets/ left as they are)"
	@$(PYTHON) -m course_lib doctor
	COURSE_DEVICE=cuda $(PYTHON) -m pytest -q -n $(GPU_JOBS) --durations=10 -m "not browser" tests
	COURSE_DEVICE=cuda $(PYTHON) -m course_lib.attention.precompile
	COURSE_DEVICE=cuda COURSE_RECORDS=off $(PYTHON) -m course_lib.tools.run_notebooks --jobs $(NB_JOBS)

# make bench autotunes (COURSE_AUTOTUNE=1) and records the chosen launches in course_lib/attention/tuned/,
# so that later processes on that GPU launch the measured kernels without tuning. BENCH=decode (etc.) runs one.
BENCH ?=
bench:
	@echo "==> make bench: course_lib vs PyTorch (attention, host_time, decode, fused, train, serving, speculative); records written to assets/benchmarks/"
	COURSE_AUTOTUNE=1 COURSE_DEVICE=cuda $(PYTHON) -m course_lib bench $(BENCH)

bench-decode:
	@$(MAKE) --no-print-directory bench BENCH=decode

lint:
	@echo "==> make lint: ruff check, ruff format --check, notebooks in sync and stripped"
	$(PYTHON) -m ruff check course_lib tests notebooks
	$(PYTHON) -m ruff format --check course_lib tests
	$(PYTHON) -m course_lib.tools.notebooks check

format:
	$(PYTHON) -m ruff format course_lib tests
	$(PYTHON) -m ruff check --fix course_lib tests notebooks

notebooks:
	@echo "==> make notebooks: notebooks/*.ipynb from notebooks/*.py, outputs stripped"
	@$(PYTHON) -m course_lib.tools.notebooks sync

# build/student is where students save their work: clean leaves it alone (make student-reset NB=all starts over)
clean:
	rm -rf $(VERIFY) build/notebook-logs .pytest_cache
