"""`stalewise view`: a read-only web viewer over the store (runs, dashboards, trajectories,
tokens). It imports `stalewise` (store, records) only and never writes to the database."""
