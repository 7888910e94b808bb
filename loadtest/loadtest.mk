# Load and soak tests (included from the main Makefile).
#
#   make loadtest                                  # its own server, the default load below
#   make loadtest LOADTEST_USERS=50 LOADTEST_RPS_PER_USER=20 LOADTEST_TIME=120s
#   make loadtest LOADTEST_USERS=80 LOADTEST_PROCESSES=4   # 800 req/s from four locust processes
#   make loadtest LOADTEST_SERVER=                 # the server `make serve` runs (RISKSERVE_PORT)
#   make loadtest LOADTEST_HOST=riskserve.example.internal:50051 LOADTEST_SERVER=
#   make soak SOAK_MINUTES=30
#
# The offered rate is LOADTEST_USERS x LOADTEST_RPS_PER_USER requests a second, on a fixed
# schedule; each call is timed from when it was due. A locust process uses one core; on a load
# machine with more, LOADTEST_PROCESSES shares the users out over that many (its workers talk
# to it on 127.0.0.1:LOADTEST_MASTER_PORT). By default the load test starts its own server on
# LOADTEST_PORT (RISKSERVE_PORT, else 50051) and refuses when something already listens there.
# With LOADTEST_SERVER empty no server is started and LOADTEST_HOST must already be serving.
# Reports go to loadtest/reports/ (CSV, HTML, the server's log, the soak samples). The CSV is
# written once a second, so its last second may be missing; the printed summary and the
# HTML report are the final tally. The run ends with one verdict line: answers a second
# against the rate offered, calls refused (RESOURCE_EXHAUSTED, UNAVAILABLE) and past their
# deadline, and the p99 against the budget (LOADTEST_DEADLINE_MS where set, else 10 ms), within
# it where at most 1 % of the calls took longer, as counted call by call:
#
#   make loadtest LOADTEST_USERS=200 LOADTEST_DEADLINE_MS=10   # above capacity: what held

LOADTEST_PYTHON ?= .venv/bin/python
LOADTEST_LOCUST ?= .venv/bin/locust
LOADTEST_PORT ?= $(or $(RISKSERVE_PORT),50051)
LOADTEST_HOST ?= 127.0.0.1:$(LOADTEST_PORT)
# The load test's own server has no metrics endpoint unless asked (a running server may hold
# RISKSERVE_METRICS_PORT). It runs as `make serve` does: behind the HAProxy front where HAProxy
# is installed (LOADTEST_FRONT=none: the server alone).
LOADTEST_METRICS_PORT ?= none
LOADTEST_FRONT ?= $(or $(RISKSERVE_FRONT),auto)
LOADTEST_SERVER ?= env RISKSERVE_METRICS_PORT=$(LOADTEST_METRICS_PORT) RISKSERVE_FRONT=$(LOADTEST_FRONT) \
	.venv/bin/riskserve serve --port $(LOADTEST_PORT)
# The default load: LOADTEST_DEFAULT_USERS x LOADTEST_DEFAULT_RPS_PER_USER requests a second,
# for LOADTEST_DEFAULT_TIME. It is the load the load-test benchmark (docs/benchmarks.md)
# shows a small CPU machine holding within the 10 ms budget; change it with that table.
LOADTEST_DEFAULT_USERS := 40
LOADTEST_DEFAULT_RPS_PER_USER := 10
LOADTEST_DEFAULT_TIME := 60s
LOADTEST_USERS ?= $(LOADTEST_DEFAULT_USERS)
LOADTEST_SPAWN_RATE ?= $(LOADTEST_USERS)
LOADTEST_RPS_PER_USER ?= $(LOADTEST_DEFAULT_RPS_PER_USER)
LOADTEST_TIME ?= $(LOADTEST_DEFAULT_TIME)
LOADTEST_PROCESSES ?= 1
LOADTEST_MASTER_PORT ?= 5557
LOADTEST_DEADLINE_MS ?= 0
# A PEM file of root certificates: talk TLS to LOADTEST_HOST (a grpcs:// host uses system roots).
LOADTEST_TLS_CA ?=
LOADTEST_REPORTS ?= loadtest/reports
LOADTEST_NAME ?= run

SOAK_MINUTES ?= 10
SOAK_USERS ?= 10
SOAK_RPS_PER_USER ?= 10
SOAK_INTERVAL_S ?= 5
SOAK_WARMUP_S ?= 60
SOAK_MAX_RSS_GROWTH_MIB ?= 64
SOAK_MAX_FD_GROWTH ?= 16

LOADTEST_LOCUST_ARGS = -f loadtest/locustfile.py --headless --host $(LOADTEST_HOST) \
	--deadline-ms $(LOADTEST_DEADLINE_MS) --tls-ca "$(LOADTEST_TLS_CA)" \
	--exit-code-on-error 1 --only-summary \
	$(if $(filter-out 1,$(LOADTEST_PROCESSES)),--processes $(LOADTEST_PROCESSES) \
		--master-bind-host 127.0.0.1 --master-bind-port $(LOADTEST_MASTER_PORT) \
		--master-port $(LOADTEST_MASTER_PORT))

.PHONY: loadtest soak

loadtest:
	@mkdir -p $(LOADTEST_REPORTS)
	$(LOADTEST_PYTHON) loadtest/harness.py run --target $(LOADTEST_HOST) --tls-ca "$(LOADTEST_TLS_CA)" \
		--server "$(LOADTEST_SERVER)" --server-log $(LOADTEST_REPORTS)/server.log -- \
		$(LOADTEST_LOCUST) $(LOADTEST_LOCUST_ARGS) \
		-u $(LOADTEST_USERS) -r $(LOADTEST_SPAWN_RATE) --rps-per-user $(LOADTEST_RPS_PER_USER) \
		--run-time $(LOADTEST_TIME) \
		--csv $(LOADTEST_REPORTS)/$(LOADTEST_NAME) --html $(LOADTEST_REPORTS)/$(LOADTEST_NAME).html

soak:
	@mkdir -p $(LOADTEST_REPORTS)
	@test -n "$(LOADTEST_SERVER)" || { echo "soak watches a local server: set LOADTEST_SERVER"; exit 2; }
	$(LOADTEST_PYTHON) loadtest/harness.py run --target $(LOADTEST_HOST) \
		--server "$(LOADTEST_SERVER)" --server-log $(LOADTEST_REPORTS)/soak-server.log \
		--soak-csv $(LOADTEST_REPORTS)/soak-resources.csv --interval-s $(SOAK_INTERVAL_S) \
		--warmup-s $(SOAK_WARMUP_S) --max-rss-growth-mib $(SOAK_MAX_RSS_GROWTH_MIB) \
		--max-fd-growth $(SOAK_MAX_FD_GROWTH) -- \
		$(LOADTEST_LOCUST) $(LOADTEST_LOCUST_ARGS) \
		-u $(SOAK_USERS) -r $(SOAK_USERS) --rps-per-user $(SOAK_RPS_PER_USER) \
		--run-time $(SOAK_MINUTES)m \
		--csv $(LOADTEST_REPORTS)/soak --html $(LOADTEST_REPORTS)/soak.html
