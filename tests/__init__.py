"""The test suite: one session-scoped Prefect server and one SeaweedFS (conftest.py); unit tests call
the plain functions, integration tests run flows end to end. `doubles.py` holds test doubles of the
product's interfaces; `waiting.py` polls real servers. May import `edgehaul` and `edgehaul_dev`."""
