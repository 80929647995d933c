from stalewise.cli import main

main()
