from mpserve.cli import main

main()
