"""curryTrain's MCP server (import name `curry_train_mcp`); start it with `curry-train mcp`."""
