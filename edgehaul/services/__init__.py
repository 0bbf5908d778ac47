"""Services the product runs beside its flows: the webhook gateway, alert automations, warm serving of
deployments and block set-up. They sit above the flows (warm serving runs them) and below the entry
points (`edgehaul.cli`, `edgehaul.node`)."""
