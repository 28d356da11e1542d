#!/bin/sh
# The production install, run by the image's runtime stage (Dockerfile) and, unchanged, by its
# test (tests/test_packaging.py): a virtualenv at $1 holding exactly the locked dependencies
# ($2, hash-checked, wheels only), then phasewatch's wheel ($3) with nothing more resolved, and
# `pip check` to prove the set is complete. $PYTHON (default python3) makes the virtualenv.
set -eu
venv="$1" lock="$2" wheel="$3"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir --quiet --require-hashes --only-binary=:all: -r "$lock"
"$venv/bin/pip" install --no-cache-dir --quiet --no-deps "$wheel"
"$venv/bin/pip" check
