"""edgehaul: move observation data from remote edge nodes to a central AI training pool, on Prefect 3.

The product package. Its subpackages follow the architecture (docs/ARCHITECTURE.md), and imports only
go down this list:

- `flows/`    one deployable flow per file: orchestration only (may import everything below);
- `tasks/`    `@task` wrappers per stage: retries, caching (import stages, platform, blocks);
- `edge/`, `uplink/`, `core/`, `training/`, `ops/`: the stages' domain logic, plain typed functions
  over a batch that need no Prefect server (import the shared formats, `blocks`, `platform`);
- `platform/` settings, S3 error rules, block loading, logging, caching, runners, alert automations,
  the webhook gateway: the Prefect and S3 glue every stage shares;
- `blocks/`   configuration blocks (registered through the `prefect.collections` entry point);
- `bundles`, `contracts`, `events`: the shared formats (bundle files, data contracts, event names);
- `data_contracts/`, `deployments/`: package data (contract YAML, `prefect.yaml`).

The repository's top-level `flows/`, `tasks/`, `blocks/`, `data_contracts/` and `deployments/` are
links into this package (the deployable entry points), so a wheel carries one copy of each.
The development harness (local stack, demo, drills, verify) is `edgehaul_dev`, beside this package
and never shipped.
"""
