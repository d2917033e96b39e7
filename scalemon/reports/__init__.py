"""Read-only views of the state and of recorded data: the snapshot JSON and its text, hangs and
the wait-for graph, groups and collectives, stragglers, summaries, exports, Flight Recorder
dumps. Nothing here changes a `JobState`."""
