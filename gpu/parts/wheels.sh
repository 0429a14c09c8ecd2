# Sourced by the device scripts: install the wheels carried in .whl (packages the device
# image lacks: psutil, xgrammar, compressed-tensors, peft, ...) into /tmp/site when any
# MODULE does not import.
#   . gpu/parts/wheels.sh MODULE [MODULE ...]
for _m in "$@"; do
    if ! ${PY:-python3} -c "import $_m" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
        break
    fi
done
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site; fi
# The device image's packages have no bytecode cache it can keep: without a writable one every
# start compiles torch's sources again (~3.4 s a start, gpu/start_profile.sh showed), which a
# pip-installed host never does. Start times measured here are a host's.
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache
