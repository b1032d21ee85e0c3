"""Reports: results.json and report.md (the one writer), gates, trend and plots."""
