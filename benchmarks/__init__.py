"""fdp's benchmarks; ``benchmarks.netsim`` is the simulated cluster the multi-node ones run on."""
