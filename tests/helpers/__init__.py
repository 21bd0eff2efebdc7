"""What the tests share besides fixtures: running the CLI, driving a server, marks."""
