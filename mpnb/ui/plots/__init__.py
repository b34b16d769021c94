"""Views of telemetry: the dashboard figure, the live and text sinks, reports and compare progress."""
