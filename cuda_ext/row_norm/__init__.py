"""RMSNorm with each row's sum of squares in an order fixed by the row alone (see rows.h)."""
