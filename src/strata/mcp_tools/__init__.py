"""Tools over MCP: the configured servers (supervised in the service's nursery), the tools a request offers the
model, and the rounds of a response in which the service calls them itself, inside the request's nursery.

Named `mcp_tools`, not `mcp`, so that it never shadows the SDK."""

from strata.mcp_tools.fitting import fit_results
from strata.mcp_tools.rounds import RoundEvents, run_rounds
from strata.mcp_tools.servers import McpServer, McpServers, McpUnavailable
from strata.mcp_tools.tools import McpTool, ToolOutput
from strata.mcp_tools.toolset import McpRequestError, Toolset, open_toolset

__all__ = ["McpRequestError", "McpServer", "McpServers", "McpTool", "McpUnavailable", "RoundEvents", "ToolOutput",
           "Toolset", "fit_results", "open_toolset", "run_rounds"]
