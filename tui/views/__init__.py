"""What each dashboard screen shows, as plain data made from the job's state (no Textual):
`overview` (the rank table, header and plots; a rank's detail), `nodes`, `collectives`,
`hang`, `flags` and `log`. The screens in `tui/screens/` draw them."""
