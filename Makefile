# The two commands of README.md. Both install what they need first.
PYTHON ?= python3

.PHONY: demo test lint bench

demo:  ## the router in front of a simulated 4-worker fleet, kvrouter vs round-robin
	./scripts/setup.sh
	kvrouter demo

test:  ## the whole test suite (installs Python deps, redis-server, chromium, kubectl; tests start their own servers)
	KVROUTER_REQUIRE_NATIVE=1 ./scripts/setup.sh --with-redis --with-browser --with-kubectl
	ruff check . && ruff format --check .
	KVROUTER_REQUIRE_NATIVE=1 $(PYTHON) -m pytest -q -p no:cacheprovider -m "not real_vllm"

lint:
	ruff check . && ruff format --check .

bench:
	$(PYTHON) bench/index_bench.py
	$(PYTHON) bench/subscriber_bench.py
	$(PYTHON) bench/proxy_bench.py
	$(PYTHON) bench/routing_bench.py --quick
