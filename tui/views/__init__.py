"""What each dashboard screen shows, as plain data made from the job's state (no Textual):
`header` (the header's figures), `rows` (the rank table's rows), `overview` (the overview
screen: header, rows and plots, or a row per node from `nodes`), `rank_detail` (one rank's
facts and series), `collectives`, `hang`, `flags` and `log`. The screens in `tui/screens/`
draw them."""
