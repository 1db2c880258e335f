#!/usr/bin/env bash
# GPU machine, in the checkout's root: build the three C extensions in place with that machine's own Python (3.12)
# and gcc, without setuptools, and say whether KVFabric finds them (PYTHONPATH as for the runs). Carry this file in
# a staged folder (the runs of 2026-12-02 carried it as .gpu/probe/build.sh).
set -u
INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
EXT=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
echo "include $INC ext $EXT"; ls "$INC/Python.h"; gcc --version | head -1
gcc -shared -fPIC -O2 -I"$INC" kvfabric/engine/_recorder.c -o "kvfabric/engine/_recorder$EXT" && echo built recorder
gcc -shared -fPIC -O2 -I"$INC" kvfabric/policies/_order.c -o "kvfabric/policies/_order$EXT" -lm && echo built order
gcc -shared -fPIC -O2 -I"$INC" kvfabric/contract/_ring.c -o "kvfabric/contract/_ring$EXT" && echo built ring
PYTHONPATH=$PWD:/tmp/site python3 -c "import kvfabric.engine.compiled as c, kvfabric.policies.native_index as n; import kvfabric.contract.ring as r; print('compiled hooks', c.BUILT, 'native index', n.BUILT, 'ring', r.COMPILED)"
