# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the release whose CPU wheel this image carries. Elsewhere, without a
# GPU, point TORCH_INDEX at https://download.pytorch.org/whl/cpu to avoid the CUDA build.
TORCH_INDEX ?=
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# DeepSpeed compiles a CPU communication op on first use (~45 s); keep it with the venv so
# another checkout's venv does not invalidate it.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: demo test lint clean system-deps peers

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/recforge generate configs/demo.yaml
	$(VENV)/bin/recforge run configs/demo.yaml

# The browser and PostgreSQL service tests use Debian's chromium and postgresql. In a
# root shell with apt (CI, a fresh build machine) they are installed when missing;
# elsewhere, or if apt cannot reach its mirror, those two tests skip.
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v chromium >/dev/null || missing="$$missing chromium"; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing (apt)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing >/dev/null) \
	    || echo "could not install$$missing: the browser/PostgreSQL tests will skip"; \
	  fi; \
	fi

test: $(VENV)/.installed system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

# Installs bench/vs_torchrec.py's peer engine (the `peers` extra) over the pinned torch; the
# bench itself never installs anything. --no-deps: torchrec's metadata asks for `fbgemm-gpu`,
# the CUDA build, which would replace fbgemm-gpu-cpu's kernels (an extra cannot say "not
# that one"), so torchrec's pure-Python dependencies are pinned here instead.
PEERS := torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict==0.15.3 pyvers==0.2.3 \
  torchmetrics==1.0.3 lightning-utilities==0.15.3 pyre-extensions==0.0.32 \
  typing-inspect==0.9.0 mypy-extensions==1.2.0

peers: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps $(PEERS)
	$(PY) -c "import torch, fbgemm_gpu, torchrec; print('torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torch', torch.__version__)"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf store data
