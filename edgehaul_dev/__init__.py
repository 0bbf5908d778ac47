"""The development harness: everything that runs the product locally or checks it, never shipped.

- `localstack`: the local stack (Prefect server, SeaweedFS, webhook gateway) on free or configured ports;
- `configure`, `credentials`: block documents and identities of a local stack;
- `deploy`: work pools, `prefect deploy`, automations and workers against a Prefect server;
- `demo`: the data path end to end; `verify`: the operator's acceptance checklist;
- `drills`: fault drills that drive the product's own entry points and account for every sample;
- `kinds_data`: real data of the non-Landsat kinds (aeon's Daphnet and BasicMotions, scikit-learn's digits) as
  raw batches and drop-folder files, and generators with a chosen class mix.

Run as `python -m edgehaul_dev <command>` (the Makefile does). It may import anything of `edgehaul`;
`edgehaul` never imports it.
"""
