"""Reading finished runs back and turning them into tables and plots."""
