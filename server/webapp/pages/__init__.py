"""What each page shows, shaped from what the queries read (pure): page context,
the step viewer's shaping, chart data, Plotly figures, the launch form's fields.
"""
