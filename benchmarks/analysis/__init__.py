"""Result tables: scripts that read what runs left behind (or a data split) and print tables;
they time nothing."""
