"""phasewatch's own JSON API under `/api`: thin routers over the store's queries."""
