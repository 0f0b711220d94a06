"""`tandem plan`: a cost model fitted on this machine, a simulator of the scheduler, the plan command."""
