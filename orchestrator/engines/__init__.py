"""Engine clients and fleets: how the orchestrator reaches inference engines (HTTP transport,
the embedded and vLLM clients, pinning, replicas behind a router, starting engine processes,
and the scripted engine that tests and benchmarks inject). The contract they implement,
`EngineClient`, is declared once in `core.engine_api`."""
