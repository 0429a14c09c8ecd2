# Sourced by the device scripts: install the wheels carried in .whl (packages the device
# image lacks: psutil, textual, ...) into /tmp/site when MODULE does not import.
#   . gpu/wheels.sh MODULE
if ! ${PY:-python3} -c "import $1" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
