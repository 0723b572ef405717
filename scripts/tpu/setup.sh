# Source me on the TPU machine: installs the carried wheels under /tmp/site.
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD/agent/zkdv/src:$PWD/agent/dvbench/src:$PWD
export PYTHONUNBUFFERED=1
