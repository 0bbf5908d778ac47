"""Benchmarks (`make bench`, `python -m benchmarks [name ...]`): every figure printed beside a baseline or
physical reference measured in the same run. Development only: may import `edgehaul`, `edgehaul_dev`
and the test doubles in `tests/`; nothing imports a benchmark."""
