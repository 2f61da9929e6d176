"""One HTTP stream's life: the ext_proc adapter, admission, settle."""
