"""Every setting of the serving commands declared once (topics), composed per command (commands), turned into
parsers, checked values and the JSON a launcher hands its children (options)."""
