"""`tandem plan`: a cost model fitted on this machine, a simulator running the engine's scheduler, the plan command."""
