"""Text for people, the lowest layer beside the tables: values in display units and table
columns (`display`), ranks as text (`ranks`), outside text made safe for a terminal
(`safe`), and whether there is a terminal at all (`terminal`)."""
