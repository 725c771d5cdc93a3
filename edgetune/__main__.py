from edgetune.cli import main

main()
