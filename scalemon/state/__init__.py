"""The model: a job's records folded into its state, the one reducer the hub and every
dashboard run (`jobstate.JobState`, inside `fold.JobFold` with its bounded series). Imports
only the top-level tables and `scalemon.text`; what people read of it is in `scalemon.reports`."""
